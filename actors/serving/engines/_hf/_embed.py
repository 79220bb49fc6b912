"""``HFEmbeddingEngine``: a sentence-transformers embedding model behind the engine contract.

An embedding request is a ``PreprocessedRequest`` with ``embed`` set and its ``token_ids`` (the
model's own tokenisation, special tokens included); its one output carries the vector as
little-endian float32 bytes. Requests arriving together share one forward pass: under load (the
last batch had more than one request, or always with ``wait_alone``) the batcher collects them
for up to ``batch_window_s`` after the first (or until ``max_batch``); otherwise a lone request
runs at once. It pads them into one batch and runs the model's modules (transformer, pooling,
normalisation) in a worker thread, so the event loop stays free.

The batcher is no task of its own (the engine contract has no task group to host one): the stream
of a request that finds no batch forming leads the next batch, so nothing outlives ``cleanup``.
Every async method works the same on asyncio and trio.

How requests end: ``stop`` with the vector; ``abort``, closing the stream early and
``pause(ABORT)`` end it ``cancelled``; ``cleanup`` raises :class:`~protocols.errors.EngineShutdown`
and a failed forward pass :class:`~protocols.errors.EngineFailure`.
"""

from __future__ import annotations

import bisect
import gc
import json
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import msgspec
import numpy as np

from actors.serving.engines._embed_options import check_dimensions
from actors.serving.engines._hf._quiet import LiveRequests
from protocols import control
from protocols.engine import (
    Capacity,
    EmbedOptions,
    Engine,
    EngineOutput,
    EngineRole,
    MemoryTag,
    PauseMode,
    PreprocessedRequest,
    Usage,
)
from protocols.errors import (
    ContextLengthExceeded,
    EngineFailure,
    EngineShutdown,
    InvalidRequest,
    RequestError,
)

__all__ = [
    "BATCH_SIZE_BUCKETS",
    "INPUT_TOKEN_BUCKETS",
    "HFEmbeddingConfig",
    "HFEmbeddingEngine",
    "HFEmbeddingStatistics",
    "check_embed_request",
    "decode_embedding_config",
    "embedding_config_from_dict",
    "encode_embedding_config",
]

#: Upper bounds of the batch-size histogram's buckets (requests per forward pass).
BATCH_SIZE_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: Upper bounds of the input-token histogram's buckets (tokens per request).
INPUT_TOKEN_BUCKETS: tuple[float, ...] = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

# The KV layout the engine reports: it has no KV cache, but routing hashes pages of this size.
_BLOCK_SIZE = 16


class HFEmbeddingConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How an ``HFEmbeddingEngine`` runs: a sentence-transformers folder (see ``find_minilm``)."""

    model_dir: str
    # torch intra-op threads (process-wide in torch): on a small shared host a preempted second
    # OpenMP thread stalls every matrix product.
    num_threads: int = 1
    max_batch: int = 32  # requests per forward pass
    # How long the first request of a batch waits for company, when the last batch had some.
    batch_window_s: float = 0.01
    # Wait out the window even after a batch of one (off: a lone client never waits for others).
    wait_alone: bool = False
    # Batches of several requests run on a thread fewer than num_threads: the root that feeds
    # them shares the host (a lone request runs on all of them).
    spare_a_core: bool = True

    def __post_init__(self) -> None:
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if not self.batch_window_s >= 0:
            raise ValueError(f"batch_window_s must be >= 0, got {self.batch_window_s}")


def embedding_config_from_dict(args: dict[str, Any]) -> HFEmbeddingConfig:
    """An :class:`HFEmbeddingConfig` from plain values (a config file's ``engine_args``); a
    wrong type or value raises ``msgspec.ValidationError``."""
    return msgspec.convert(args, HFEmbeddingConfig)


def encode_embedding_config(config: HFEmbeddingConfig) -> bytes:
    """msgpack, as the engine host receives it (see :func:`decode_embedding_config`)."""
    return msgspec.msgpack.encode(config)


def decode_embedding_config(data: bytes) -> HFEmbeddingConfig:
    """The reverse of :func:`encode_embedding_config`."""
    return msgspec.msgpack.decode(data, type=HFEmbeddingConfig)


def check_embed_request(request: PreprocessedRequest, native_dim: int) -> EmbedOptions:
    """The request's ``embed`` options if an engine whose vectors have ``native_dim``
    components can serve it; else :class:`InvalidRequest` (these models are not trained to be
    truncated, so ``dimensions`` must be the native size)."""
    embed = request.embed
    if embed is None:
        raise InvalidRequest(
            "this engine serves embedding models: the request needs 'embed' options"
        )
    if request.image is not None:
        raise InvalidRequest("an embedding engine cannot serve an image request")
    check_dimensions(embed, native_dim)
    if not request.token_ids:
        raise InvalidRequest("token_ids is empty")
    return embed


class _Histogram:
    """The engine's mutable side of a :class:`~protocols.control.Histogram`."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> control.Histogram:
        return control.Histogram(self.bounds, tuple(self.counts), self.sum)


@dataclass(frozen=True)
class HFEmbeddingStatistics:
    """A snapshot of the engine (``HFEmbeddingEngine.statistics()``); the histograms are the
    ones Dynamo's embedding workers publish (requests per forward pass, tokens per request)."""

    live_requests: int = 0  # streams the engine still owes an ending
    queued: int = 0  # waiting for a forward pass
    running: int = 0  # in the forward pass in flight
    paused: bool = False
    released: frozenset[MemoryTag] = frozenset()
    batches: int = 0  # forward passes run
    embedded: int = 0  # requests answered with a vector
    input_tokens: int = 0  # tokens of the requests run (padding excluded)
    last_batch_size: int = 0
    max_batch_size: int = 0  # the largest batch so far
    failures: int = 0  # forward passes that raised
    batch_size: control.Histogram = field(
        default_factory=lambda: control.Histogram.empty(BATCH_SIZE_BUCKETS)
    )
    request_input_tokens: control.Histogram = field(
        default_factory=lambda: control.Histogram.empty(INPUT_TOKEN_BUCKETS)
    )

    def counters(self) -> dict[str, int]:
        """The figures the worker exports (``actorserve_worker_<name>``)."""
        return {"embedding_batches": self.batches, "embedding_requests": self.embedded}

    def histograms(self) -> dict[str, control.Histogram]:
        """Dynamo's embedding histograms, for the worker to export."""
        return {
            "embedding_batch_size": self.batch_size,
            "embedding_input_tokens": self.request_input_tokens,
        }

    # The engine contract's ``EngineStatistics``.
    @property
    def in_flight(self) -> int:
        return self.live_requests

    @property
    def used_blocks(self) -> int:
        return 0  # no KV cache

    @property
    def prefill_tokens(self) -> int:
        return self.input_tokens

    @property
    def kv_received_tokens(self) -> int:
        return 0  # an embedding engine receives no KV


@dataclass(eq=False)
class _Pending:
    """One request between its stream and the batch that answers it."""

    rid: str
    token_ids: list[int]
    arrived: float
    done: anyio.Event = field(default_factory=anyio.Event)
    wake: anyio.Event = field(default_factory=anyio.Event)  # it may lead the next batch
    vector: bytes | None = None
    error: RequestError | None = None


@dataclass(frozen=True)
class _Loaded:
    """What ``start`` learns from the model folder."""

    dim: int
    context_length: int
    vocab_size: int
    cls_id: int


class HFEmbeddingEngine(LiveRequests):
    """An :class:`~protocols.engine.Engine` running a sentence-transformers model on the CPU.

    The batcher is no task of its own (the engine contract has no task group to host one): the
    stream of a request that finds no batch forming leads the next one (waits out the window,
    runs the forward pass, answers every request in it); when it is done, the oldest queued
    request's stream leads the one after.
    """

    def __init__(self, config: HFEmbeddingConfig) -> None:
        self.config = config
        self._model: Any = None
        self._info: _Loaded | None = None
        self._capacity: Capacity | None = None
        self._state = "new"  # new -> starting -> running -> closed
        self._queue: deque[_Pending] = deque()
        self._live: dict[str, _Pending] = {}
        self._running: list[_Pending] = []
        self._leading = False  # a stream is collecting or running a batch
        self._arrival: anyio.Event | None = None  # set when a request joins the queue
        self._forward_lock = anyio.Lock()  # held while the model runs (or loads)
        self._paused = False
        self._released: frozenset[MemoryTag] = frozenset()  # swapped whole, never mutated
        self._cleaned: anyio.Event | None = None
        self._batches = self._embedded = self._input_tokens = 0
        self._last_batch = self._max_batch = self._failures = 0
        self._batch_hist = _Histogram(BATCH_SIZE_BUCKETS)
        self._token_hist = _Histogram(INPUT_TOKEN_BUCKETS)

    async def __aenter__(self) -> HFEmbeddingEngine:
        try:
            await self.start()
        except BaseException:
            await self.cleanup()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.cleanup()

    # ---- public properties ---------------------------------------------------------------
    @property
    def role(self) -> EngineRole:
        return "aggregated"

    @property
    def model_dir(self) -> Path:
        """The sentence-transformers folder (model and tokenizer)."""
        return Path(self.config.model_dir)

    @property
    def tokenizer_path(self) -> Path:
        """Where ``AutoTokenizer.from_pretrained`` finds the model's tokenizer."""
        return self.model_dir

    @property
    def dimensions(self) -> int:
        """The length of the model's vectors; set by ``start``."""
        return self._require_info().dim

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> Capacity:
        """Load the model in a worker thread; returns the capacity."""
        if self._state != "new":
            raise RuntimeError(f"HFEmbeddingEngine.start: the engine is {self._state}")
        self._state = "starting"
        try:
            model, info = await anyio.to_thread.run_sync(self._load)
            if self._state != "starting":  # cleanup ran while the model loaded
                raise EngineShutdown("the engine was cleaned up while starting")
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.cleanup()
            raise
        self._model, self._info = model, info
        self._state = "running"
        cfg = self.config
        self._capacity = Capacity(
            total_kv_blocks=0,
            block_size=_BLOCK_SIZE,
            max_running_requests=cfg.max_batch,
            max_batch_tokens=cfg.max_batch * info.context_length,
            context_length=info.context_length,
        )
        return self._capacity

    def _load(self) -> tuple[Any, _Loaded]:
        """In a worker thread: threads, the model (a ``SentenceTransformer``, handled as Any:
        its stubs are partial), and what the engine needs to know of it."""
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(self.config.num_threads)
        folder = self.model_dir
        model: Any = SentenceTransformer(str(folder), device="cpu", local_files_only=True)
        model.eval()
        tokenizer = model.tokenizer
        cls_id = tokenizer.cls_token_id
        if cls_id is None:
            cls_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 0
        context = int(model.max_seq_length or 0)
        sbert = folder / "sentence_bert_config.json"
        if sbert.is_file():
            context = int(json.loads(sbert.read_text()).get("max_seq_length", context))
        # A warm-up forward pass tells the vector's length whatever the model's API calls it.
        probe = _forward(model, [[int(cls_id)]], self.config.num_threads)
        return model, _Loaded(len(probe[0]) // 4, context, len(tokenizer), int(cls_id))

    async def cleanup(self) -> None:
        """Fail what still runs with ``EngineShutdown``, wait for a forward pass in flight,
        free the model. Idempotent; the work runs once (also after a failed ``start``);
        concurrent callers wait for it."""
        if self._cleaned is not None:
            await self._cleaned.wait()
            return
        self._cleaned = anyio.Event()
        self._state = "closed"
        try:
            with anyio.CancelScope(shield=True):
                shutdown = EngineShutdown("the engine shut down")
                for pending in list(self._live.values()):
                    self._finish(pending, error=shutdown)
                async with self._forward_lock:  # a batch in flight ends first
                    self._model = None
        finally:
            self._model = None
            gc.collect()
            self._cleaned.set()

    # ---- generation ----------------------------------------------------------------------
    def generate(self, request: PreprocessedRequest) -> AsyncGenerator[EngineOutput, None]:
        """Stream ``request``'s one output (its vector). Closing the iterator early aborts it.

        The request is checked here (typed errors raise at once); it joins the queue when the
        iteration starts.
        """
        info = self._require_info()
        check_embed_request(request, info.dim)
        n = len(request.token_ids)
        if n > info.context_length:
            raise ContextLengthExceeded(
                f"{n} input tokens; this model takes at most {info.context_length}"
            )
        bad = next((t for t in request.token_ids if not 0 <= t < info.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary ({info.vocab_size})")
        if request.rid in self._live:
            raise InvalidRequest(f"request id {request.rid!r} is already running")
        return self._run(_Pending(request.rid, list(request.token_ids), anyio.current_time()))

    async def _run(self, pending: _Pending) -> AsyncGenerator[EngineOutput, None]:
        self._require_info()
        if pending.rid in self._live:
            raise InvalidRequest(f"request id {pending.rid!r} is already running")
        pending.arrived = anyio.current_time()
        self._live[pending.rid] = pending
        self._queue.append(pending)
        if self._arrival is not None:
            self._arrival.set()
        try:
            while not pending.done.is_set():
                if not self._leading and self._can_run():
                    await self._lead()
                else:
                    pending.wake = anyio.Event()
                    await pending.wake.wait()
        finally:
            if not pending.done.is_set():  # the reader left (cancelled or closed): abort
                self._finish(pending)
        usage = Usage(prompt_tokens=len(pending.token_ids), completion_tokens=0)
        if pending.error is not None:
            raise pending.error
        if pending.vector is None:
            yield EngineOutput(finish_reason="cancelled", usage=usage)
            return
        yield EngineOutput(embedding=pending.vector, finish_reason="stop", usage=usage)

    def _finish(
        self,
        pending: _Pending,
        vector: bytes | None = None,
        error: RequestError | None = None,
    ) -> None:
        """End ``pending``: with its vector, an error, or neither (cancelled)."""
        if pending.done.is_set():
            return
        pending.vector, pending.error = vector, error
        pending.done.set()
        pending.wake.set()
        if self._live.get(pending.rid) is pending:
            del self._live[pending.rid]
        try:
            self._queue.remove(pending)
        except ValueError:
            pass  # already taken into a batch
        self._settle()
        self._hand_over()  # it may have been woken to lead the next batch

    def _can_run(self) -> bool:
        return (
            bool(self._queue)
            and not self._paused
            and self._model is not None
            and self._state == "running"
        )

    def _hand_over(self) -> None:
        """Wake the oldest queued request's stream to lead the next batch, if one may run."""
        if not self._leading and self._can_run():
            self._queue[0].wake.set()

    async def _lead(self) -> None:
        """Wait out the window, run the batch, answer it; then hand the lead on.

        Nothing leaves the queue before the forward lock is held: a leader cancelled while it
        waits leaves every request queued for the next one.
        """
        self._leading = True
        try:
            await self._window()
            async with self._forward_lock:
                if not self._can_run():  # paused, released, closed or emptied meanwhile
                    return
                n = min(self.config.max_batch, len(self._queue))
                await self._run_batch([self._queue.popleft() for _ in range(n)])
        finally:
            self._leading = False
            self._hand_over()

    async def _window(self) -> None:
        """Until ``batch_window_s`` after the first queued request came, or a full batch; not
        at all when the last batch had no company, so a lone client never waits for others."""
        cfg = self.config
        if self._last_batch <= 1 and not cfg.wait_alone:
            return
        # The window counts from the first request's arrival: one that waited behind a
        # forward pass waits no longer.
        deadline = self._queue[0].arrived + cfg.batch_window_s
        try:
            while 0 < len(self._queue) < cfg.max_batch:
                left = deadline - anyio.current_time()
                if left <= 0:
                    break
                self._arrival = anyio.Event()
                with anyio.move_on_after(left):
                    await self._arrival.wait()
        finally:
            self._arrival = None

    async def _run_batch(self, batch: list[_Pending]) -> None:
        """With the forward lock held: one forward pass over ``batch``, each request answered."""
        self._running = batch
        try:
            # Shielded: the batch answers every request in it, whoever's stream leads it (the
            # thread cannot be stopped anyway).
            with anyio.CancelScope(shield=True):
                ids = [p.token_ids for p in batch]
                # A lone request has the host to itself; a batch with company means a busy
                # root on the same host, feeding the next batch: it is left a core.
                threads = self.config.num_threads
                if len(batch) > 1 and self.config.spare_a_core:
                    threads = max(1, threads - 1)
                vectors = await anyio.to_thread.run_sync(_forward, self._model, ids, threads)
        except Exception as exc:  # a failed forward fails its batch, not the engine
            self._failures += 1
            failure = EngineFailure(f"the embedding forward pass failed: {exc!r}")
            for pending in batch:
                self._finish(pending, error=failure)
            return
        finally:
            self._running = []
        self._batches += 1
        self._last_batch = len(batch)
        self._max_batch = max(self._max_batch, len(batch))
        self._batch_hist.observe(len(batch))
        for pending, vector in zip(batch, vectors, strict=True):
            n = len(pending.token_ids)
            self._input_tokens += n
            self._token_hist.observe(n)
            if not pending.done.is_set():
                self._embedded += 1
                self._finish(pending, vector=vector)

    def _require_info(self) -> _Loaded:
        if self._info is None or self._state != "running":
            raise EngineShutdown(f"the engine is not running ({self._state})")
        return self._info

    # ---- control -------------------------------------------------------------------------
    async def abort(self, rid: str) -> None:
        """Abort ``rid`` (queued or in the forward pass in flight): its stream ends
        ``cancelled`` (after that pass, if it is in one). Unknown: no-op."""
        pending = self._live.get(rid)
        if pending is not None:
            self._finish(pending)

    async def pause(self, mode: PauseMode) -> None:
        """Start no forward pass until :meth:`continue_generation`; returns once none is in
        flight. ``ABORT`` also ends every request ``cancelled``; ``RETRACT`` and ``IN_PLACE``
        keep them queued (there is no KV to free)."""
        self._paused = True
        if mode is PauseMode.ABORT:
            for pending in list(self._live.values()):
                self._finish(pending)
        async with self._forward_lock:
            pass

    async def continue_generation(self) -> None:
        """Undo ``pause``."""
        self._paused = False
        self._hand_over()

    async def release_memory(self, tags: Sequence[MemoryTag]) -> None:
        """``weights``: drop the model (requests wait until ``resume_memory``); ``kv_cache``
        and ``cuda_graph``: nothing to free (the tags are recorded as the ``hf`` engine does)."""
        todo = set(tags) - self._released
        if MemoryTag.WEIGHTS in todo:
            async with self._forward_lock:
                self._model = None
                await anyio.to_thread.run_sync(gc.collect)
        self._released = self._released | (todo - {MemoryTag.CUDA_GRAPH})

    async def resume_memory(self, tags: Sequence[MemoryTag]) -> None:
        """Bring back what ``release_memory`` freed (the weights reload from the folder)."""
        todo = set(tags)
        if MemoryTag.WEIGHTS in todo and self._model is None and self._state == "running":
            async with self._forward_lock:
                model, _ = await anyio.to_thread.run_sync(self._load)
                if self._state == "running":
                    self._model = model
        self._released = self._released - todo
        self._hand_over()

    async def flush_cache(self) -> bool:
        """There is no cache to flush: always True."""
        self._require_info()
        return True

    def health_payload(self) -> PreprocessedRequest:
        """A one-token embed canary (the model's CLS id) with a fresh rid."""
        cls_id = self._info.cls_id if self._info is not None else 0
        return PreprocessedRequest(
            rid=f"health-{uuid.uuid4().hex}",
            token_ids=[cls_id],
            embed=EmbedOptions(),
            health_check=True,
        )

    def statistics(self) -> HFEmbeddingStatistics:
        """A snapshot of the queue, the batches run and their histograms."""
        return HFEmbeddingStatistics(
            live_requests=len(self._live),
            queued=len(self._queue),
            running=len(self._running),
            paused=self._paused,
            released=self._released,
            batches=self._batches,
            embedded=self._embedded,
            input_tokens=self._input_tokens,
            last_batch_size=self._last_batch,
            max_batch_size=self._max_batch,
            failures=self._failures,
            batch_size=self._batch_hist.snapshot(),
            request_input_tokens=self._token_hist.snapshot(),
        )


if TYPE_CHECKING:

    def _conforms(engine: HFEmbeddingEngine) -> Engine:
        return engine  # mypy checks the engine against the contract


def _forward(model: Any, batch: list[list[int]], threads: int) -> list[bytes]:
    """In a worker thread: the vectors of ``batch`` (token id lists), as float32 LE bytes.

    The batch is padded on the right with an attention mask, as the model's own tokenizer
    would pad it; pooling and normalisation are the model's modules, so the vectors equal
    ``SentenceTransformer.encode``'s.
    """
    import torch

    if model is None:
        raise RuntimeError("the model's weights are released")
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    width = max(len(ids) for ids in batch)
    input_ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, ids in enumerate(batch):
        input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask[i, : len(ids)] = 1
    features = {
        "input_ids": input_ids,
        "attention_mask": mask,
        "token_type_ids": torch.zeros_like(input_ids),
    }
    with torch.inference_mode():
        out = model(features)["sentence_embedding"]
    rows = out.to(torch.float32).cpu().numpy().astype("<f4", copy=False)
    return [np.ascontiguousarray(row).tobytes() for row in rows]
