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

import dataclasses
import gc
import threading
import uuid
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any

import anyio
import torch

from protocols.engine import (
    Capacity,
    EngineOutput,
    EngineRole,
    MemoryTag,
    PauseMode,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from protocols.errors import (
    EngineShutdown,
    InvalidRequest,
    RequestCancelled,
    RequestError,
)

from .._grammar import Vocabulary
from .._heap import free_heap, malloc_trim
from ._attention import register_paged_attention
from ._batch import BatchCore, Delivery, Seq
from ._kv import KVBuffer, KVLayout, PagePool
from ._model import ModelFiles, find_smollm2, load_model
from ._quiet import LiveRequests
from ._request import Limits, RequestStream, build_seq
from ._runner import StepRunner
from ._types import HFEngineConfig, HFEngineStatistics, PrefilledKV

__all__ = ["HFEngine"]


class HFEngine(LiveRequests):
    """An :class:`~protocols.engine.Engine` running a transformers causal LM (fp32)."""

    def __init__(self, config: HFEngineConfig | None = None) -> None:
        self.config = config or HFEngineConfig()
        self._device = torch.device(
            self.config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        )
        self._files: ModelFiles | None = None
        self._folder: Path | None = None
        self._runner: StepRunner | None = None
        self._streams: dict[str, RequestStream] = {}
        self._live: set[str] = set()  # rids the core still holds
        self._released: frozenset[MemoryTag] = frozenset()  # swapped whole, never mutated
        self._stats = HFEngineStatistics()
        self._capacity: Capacity | None = None
        self._limits: Limits | None = None
        self._bos = 0
        self._closing = False
        self._cleaned: anyio.Event | None = None
        self._vocab: Vocabulary | None = None
        self._vocab_lock = threading.Lock()

    # ---- public properties ---------------------------------------------------------------
    @property
    def role(self) -> EngineRole:
        return self.config.role

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
        if self._limits is None:
            raise RuntimeError("the engine is not started")
        return self._limits.layout

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
        runner = StepRunner(self._init_core, self._on_round, on_idle=self._snapshot)
        try:
            await runner.start()
            if self._closing:  # cleanup ran while the model loaded
                raise EngineShutdown("the engine was cleaned up while starting")
        except BaseException:
            # A failed or cancelled start must not leave a loaded model serving on its thread.
            with anyio.CancelScope(shield=True):
                await runner.stop(_final_command)
            raise
        self._runner = runner
        assert self._capacity is not None
        return self._capacity

    def _init_core(self) -> BatchCore:
        """On the step thread: threads, model, pool."""
        cfg = self.config
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        model = self._load_weights()
        mc = model.config
        layout = KVLayout.from_config(mc, cfg.block_size)
        pool = PagePool(layout, layout.pages_needed(cfg.kv_cache_tokens), self._device)
        context = int(getattr(mc, "max_position_embeddings", 0) or cfg.kv_cache_tokens)
        if cfg.context_length is not None:
            context = min(context, cfg.context_length)
        self._bos = int(mc.bos_token_id if mc.bos_token_id is not None else 0)
        self._limits = Limits(
            context_length=context,
            total_pages=pool.num_pages,
            layout=layout,
            vocab_size=int(mc.vocab_size),
            eos_token_ids=frozenset(
                _ids(mc.eos_token_id) | _ids(model.generation_config.eos_token_id)
            ),
            device=self._device,
            vocabulary=self._vocabulary,
        )
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

    def _vocabulary(self) -> Vocabulary:
        """The tokenizer as the grammar engine sees it, made on the first grammar's admission
        (most engines never see one) and kept."""
        with self._vocab_lock:
            if self._vocab is None:
                assert self._folder is not None and self._limits is not None
                self._vocab = Vocabulary.from_tokenizer_file(
                    self._folder / "tokenizer.json",
                    size=self._limits.vocab_size,
                    eos_token_ids=sorted(self._limits.eos_token_ids),
                )
            return self._vocab

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
            free_heap()
            self._cleaned.set()

    # ---- generation ----------------------------------------------------------------------
    def generate(self, request: PreprocessedRequest) -> AsyncGenerator[EngineOutput, None]:
        """Stream ``request``'s new tokens. Closing the iterator early aborts the request.

        The request is checked here (typed errors raise at once); it is submitted when the
        iteration starts.
        """
        return self._run(self._make_seq(request))

    def check(self, request: PreprocessedRequest) -> None:
        """Validate ``request`` as :meth:`generate` would (typed errors), running nothing: a
        disaggregated decode worker rejects a bad request before any KV moves for it."""
        self._make_seq(request)

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
        if final is None or not final.token_ids or final.usage is None:
            raise RequestCancelled(f"{seq.rid}: the prefill was aborted")
        return PrefilledKV(
            seq.rid,
            final.token_ids[0],
            len(seq.prompt),
            pages,
            tuple(ids),
            final.usage,
            final.logprobs,
            final.prompt_logprobs,
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
        arrives; the caller may reuse its buffer from then on. A request with ``min_tokens``
        whose first token the prefill could not have drawn under it (a stop token, or any
        sampled one) recomputes its prompt here instead, leaving the pages untouched.
        """
        seq = self._make_seq(request)
        seq.prompt_logprobs = None  # the prefill worker's first output carried them
        assert self._limits is not None
        if not 0 <= first_token < self._limits.vocab_size:
            raise InvalidRequest(f"first token {first_token} is outside the vocabulary")
        if seq.min_tokens > 1 and (first_token in seq.stop_ids or not seq.params.greedy):
            # The prefill worker draws its single token without the request's min_tokens (a
            # max_tokens-1 request cannot carry it), so here it may differ from what this
            # request may draw first: recompute the prompt locally, as aggregated serving does.
            return self._run(seq)
        n_pages = self.kv_layout.pages_needed(len(seq.prompt))
        ids = list(range(n_pages)) if page_ids is None else [int(i) for i in page_ids]
        seq.kv_in, seq.kv_in_ids = self._page_view(pages, ids, n_pages), ids
        grammar = seq.grammar
        if (
            grammar is not None
            and first_token not in seq.stop_ids
            and not grammar.accept(first_token)
        ):
            raise InvalidRequest(f"first token {first_token} does not follow the grammar")
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
        stream = RequestStream()
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
        self._settle()

    def _make_seq(self, request: PreprocessedRequest) -> Seq:
        self._require_runner()
        assert self._limits is not None
        if request.rid in self._live:
            raise InvalidRequest(f"request id {request.rid!r} is already running")
        return build_seq(request, self._limits)

    def _require_runner(self) -> StepRunner:
        if self._runner is None or self._closing:
            raise EngineShutdown("the engine is not running")
        return self._runner

    # ---- control -------------------------------------------------------------------------
    async def abort(self, rid: str) -> None:
        """Abort ``rid`` (queued or running); returns once its KV is freed. Unknown: no-op."""
        await self._require_runner().call(lambda core, out: out.extend(core.abort(rid)))

    async def pause(self, mode: PauseMode) -> None:
        """Stop generating; new requests queue until :meth:`continue_generation`.

        ``ABORT`` ends every request ``cancelled``; ``RETRACT`` frees the KV of running requests
        (they recompute prompt + output after ``continue``); ``IN_PLACE`` keeps everything.
        """
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
        malloc_trim()

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
        """A snapshot: the step thread's state after its last round, plus the async side's."""
        return dataclasses.replace(
            self._stats, live_requests=len(self._live), released=self._released
        )

    def _snapshot(self, core: BatchCore) -> None:
        """On the step thread after every round: one atomic reference swap."""
        self._stats = HFEngineStatistics(
            running=len(core.running),
            waiting=len(core.waiting),
            kv_pages_total=core.pool.num_pages,
            kv_pages_free=core.pool.num_free,
            paused=core.paused,
            steps=core.steps,
            tokens_generated=core.tokens_generated,
            preemptions=core.preemptions,
        )


def _final_command(core: BatchCore, out: list[Delivery]) -> None:
    out.extend(core.shutdown())
    core.model = None


def _ids(value: int | list[int] | None) -> set[int]:
    if value is None:
        return set()
    return {value} if isinstance(value, int) else set(value)
