"""The SGLang backend: :class:`SGLangEngine` wraps ``sglang.Engine`` behind the engine contract.

SGLang's engine is asyncio-only (its tokenizer manager runs asyncio tasks on the loop that first
uses it), so this backend runs on asyncio and refuses trio with :class:`SGLangRequiresAsyncio`.

How it uses SGLang (every call is checked against the signature records of each supported SGLang
version, ``records/*.json``, see ``_record``; where versions differ, the backend inspects the live
SGLang: ``async_generate``'s parameters, ``KVEventsConfig``'s fields, the classes it has):

- ``async_generate(input_ids=..., stream=True, rid=<our rid>, ...)``; with incremental streaming
  each chunk's ``output_ids`` are the new tokens. Submitting our own rid makes an abort addressable
  before the first token.
- Control goes to the tokenizer manager's *async* methods (``pause_generation``,
  ``release_memory_occupation``, ...). ``Engine``'s synchronous wrappers are never called: each runs
  ``loop.run_until_complete`` on the engine's loop, which cannot work while that loop runs this
  backend, and from a worker thread it would drive the tokenizer manager's futures from a second
  loop. Only ``Engine.shutdown`` (plain blocking code) runs in a worker thread.
- An embedding model (``kind="embedding"``, SGLang's ``is_embedding``): an ``embed`` request goes to
  ``tokenizer_manager.generate_request(EmbeddingReqInput(input_ids=..., rid=...))`` as Dynamo sends
  it (``Engine.async_encode`` takes text only), and its one answer's ``embedding`` becomes the
  output's little-endian float32 vector.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, NoReturn, get_args

import anyio
import msgspec
import numpy as np
import sniffio

from actors.lowlevel import LOOPBACK, free_port
from actors.serving.engines._embed_options import check_dimensions, wrong_dimensions
from actors.serving.engines._sglang._config import (
    Role,
    SGLangAPI,
    build_capacity,
    check_role_args,
    force_server_args,
    kv_events_config,
    kv_events_endpoints,
    load_sglang_api,
    requested_dp_size,
)
from actors.serving.engines._sglang._launch import (
    abort_needs_retry,
    construct_engine,
    server_info,
    shutdown_engine,
    warm_up,
)
from actors.serving.engines._sglang._signals import DeferredSignalHandlers
from actors.serving.engines._sglang._stream import (
    RequestStream,
    StreamConfig,
    dispatched,
    stopped_error,
    worker_abort_error,
)
from actors.serving.errors import SGLangRequiresAsyncio
from protocols.engine import (
    BootstrapInfo,
    Capacity,
    EmbedOptions,
    Engine,
    EngineOutput,
    MemoryTag,
    ModelKind,
    PauseMode,
    PreprocessedRequest,
    RoutingHints,
    SamplingOptions,
    StopConditions,
    Usage,
)
from protocols.errors import (
    EngineFailure,
    EngineShutdown,
    InvalidRequest,
    RequestError,
    StreamIncomplete,
    WorkerDraining,
)

__all__ = ["SGLangEngine", "SGLangEngineStatistics", "SGLangRequiresAsyncio"]

_log = logging.getLogger(__name__)

_TAG_ORDER = (MemoryTag.KV_CACHE, MemoryTag.WEIGHTS, MemoryTag.CUDA_GRAPH)
# Aborts that arrive before their generate began are remembered (bounded, for a while); rids
# that already finished are not, so a later request reusing the rid is not cancelled by them.
_EARLY_ABORTS_MAX = 4096
_EARLY_ABORT_TTL_S = 60.0
_SHUTDOWN_DRAIN_S = 2.0  # cleanup: how long in-flight streams get to end after their abort
# SGLang's scheduler asserts it is idle on a release (a failed assertion kills it), and an
# aborted request leaves its registry only once the scheduler has let it go.
_RELEASE_IDLE_WAIT_S = 10.0


class SGLangEngineStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of the backend's state (the engine contract's ``EngineStatistics``; SGLang's
    own counts come from its metrics)."""

    role: str
    started: bool
    closed: bool
    in_flight: int
    paused: str | None
    released: frozenset[MemoryTag]
    deferred_signals: dict[int, int]

    @property
    def used_blocks(self) -> int:
        return -1  # not counted here

    @property
    def prefill_tokens(self) -> int:
        return -1  # not counted here

    @property
    def kv_received_tokens(self) -> int:
        return -1  # not counted here


class SGLangEngine:
    """The engine contract (``protocols.engine.Engine``) on a real ``sglang.Engine``.

    ``server_args`` are SGLang's server args, passed through untouched except for the settings
    the backend forces (see ``force_server_args``). ``role`` is ``aggregated``, ``prefill`` or
    ``decode``; prefill and decode use SGLang's own PD disaggregation over NIXL (actorserve's own
    KV transfer is not used). ``memory_release`` turns on SGLang's memory saver (required for
    ``release_memory``); ``kv_events`` creates a loopback KV-events config when none was given.
    ``kind`` is what the model serves (``protocols.engine.ModelKind``): ``embedding`` sets SGLang's
    ``is_embedding`` and takes ``embed`` requests only (aggregated role only).
    ``api`` is the injection seam (default: import SGLang in ``start``).
    """

    def __init__(
        self,
        server_args: Mapping[str, Any],
        *,
        role: Role = "aggregated",
        kind: str = "chat",
        bootstrap_host: str = LOOPBACK,
        memory_release: bool = False,
        kv_events: bool = False,
        bos_token_id: int | None = None,
        warmup: bool = True,
        warmup_timeout: float = 1800.0,
        construct_in_thread: bool = True,
        api: SGLangAPI | Callable[[], SGLangAPI] | None = None,
    ) -> None:
        check_role_args(server_args, role)
        if kind not in get_args(ModelKind):
            raise ValueError(f"kind must be one of {get_args(ModelKind)}, not {kind!r}")
        self._args = dict(server_args)
        self.kind = kind
        if kind == "embedding":
            if role != "aggregated":
                raise ValueError(f"an embedding model serves aggregated only, not as {role!r}")
            if self._args.get("is_embedding") is False:
                raise ValueError("is_embedding=False contradicts kind 'embedding'")
            self._args["is_embedding"] = True
        self._embed_dim: int | None = None  # an embedding model's vector length, once seen
        self._embed_trace_header = False  # EmbeddingReqInput takes external_trace_header
        self.role: Role = role
        self._bootstrap_host = bootstrap_host
        port = self._args.get("disaggregation_bootstrap_port")
        self._bootstrap_port: int | None = None
        if role != "aggregated":
            self._bootstrap_port = int(port) if port is not None else free_port()
        self._memory_release = memory_release
        self._kv_events = kv_events
        self._kv_events_json: str | None = None  # set at start: its form depends on SGLang's API
        self._bos = bos_token_id
        self._warmup_enabled = warmup
        self._warmup_timeout = warmup_timeout
        self._construct_in_thread = construct_in_thread
        self._api_source = api if api is not None else load_sglang_api
        self._api: SGLangAPI | None = None
        self._engine: Any = None
        self._tm: Any = None
        self._capacity: Capacity | None = None
        self._info: dict[str, Any] = {}
        self._signals: DeferredSignalHandlers | None = None
        self._shutdown_signal: int | None = None
        self._streams: dict[str, RequestStream | EmbedStream] = {}
        self._early_aborts: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._finished_rids: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._idle: anyio.Event | None = None
        self._paused: PauseMode | None = None
        self._released: set[MemoryTag] = set()
        self._started = False
        self._closing = False
        self._cleanup_done: anyio.Event | None = None
        self._stream_config: StreamConfig | None = None

    # ---------------------------------------------------------------------------- lifecycle

    async def start(self) -> Capacity:
        """Launch SGLang (in a worker thread), then report capacity. Prefill warms up first."""
        if sniffio.current_async_library() != "asyncio":
            raise SGLangRequiresAsyncio(
                "the SGLang backend needs the asyncio backend: SGLang's engine is asyncio-only"
            )
        if self._started or self._closing:
            raise RuntimeError("SGLangEngine.start may run once")
        self._started = True
        source = self._api_source
        api = source if isinstance(source, SGLangAPI) else source()
        self._api = api
        self._kv_events_json = kv_events_config(
            self._args.get("kv_events_config"),
            requested_dp_size(self._args),
            self._kv_events,
            can_bind="bind" in api.kv_events_config_fields,
        )
        kwargs = force_server_args(
            self._args,
            role=self.role,
            api=api,
            bootstrap_port=self._bootstrap_port,
            memory_release=self._memory_release,
            kv_events=self._kv_events_json,
        )
        loop = asyncio.get_running_loop()
        # Capture SGLang's SIGTERM/SIGINT registrations before anything of SGLang runs.
        self._signals = DeferredSignalHandlers(loop)
        self._signals.install()
        await construct_engine(
            api, kwargs, in_thread=self._construct_in_thread, on_built=self._built
        )
        engine = self._engine
        tm = engine.tokenizer_manager
        self._tm = tm
        # Bind SGLang's handle loop (and its signal registrations) to this loop and thread now,
        # not lazily on the first request.
        tm.auto_create_handle_loop()
        self._info = await server_info(engine, tm)
        params = frozenset(inspect.signature(engine.async_generate).parameters)
        self._embed_trace_header = (
            "external_trace_header" in inspect.signature(api.EmbeddingReqInput).parameters
        )
        self._stream_config = StreamConfig(
            role=self.role,
            bootstrap_host=self._bootstrap_host,
            bootstrap_port=self._bootstrap_port,
            dp_param=next(
                (p for p in ("routed_dp_rank", "data_parallel_rank") if p in params), None
            ),
            supports_priority="priority" in params,
            retry_aborts=abort_needs_retry(self._info),
            aborted_errors=(
                (api.RequestAbortedError,) if api.RequestAbortedError is not None else ()
            ),
            forward_empty=self.kind == "dllm" or bool(self._args.get("dllm_algorithm")),
            trace_header="external_trace_header" in params,
        )
        dp = int(self._info.get("num_dp_ranks") or requested_dp_size(self._info))
        metrics = str(getattr(engine.port_args, "metrics_ipc_name", "") or "")
        self._capacity = build_capacity(
            self._info,
            bootstrap=(
                BootstrapInfo(host=self._bootstrap_host, port=self._bootstrap_port, room=0)
                if self.role == "prefill" and self._bootstrap_port is not None
                else None
            ),
            kv_events_endpoints=kv_events_endpoints(self._kv_events_json, dp),
            kv_events_replay_endpoints=kv_events_endpoints(
                self._kv_events_json, dp, "replay_endpoint"
            ),
            # Load metrics are read only from a worker-owned ipc path (see _sglang_metrics).
            metrics_endpoint=(
                metrics if self._kv_events_json and metrics.startswith("ipc://") else None
            ),
            prefills_alone=self.role != "decode",
        )
        if self._warmup_enabled and self.kind == "embedding":
            await self._warm_up_embedding()
        elif self._warmup_enabled:
            await warm_up(engine, api, self.role, self._bootstrap_port, self._warmup_timeout)
        return self._capacity

    async def _warm_up_embedding(self) -> None:
        """One short embed before the worker is routable (an embedding model cannot generate:
        ``warm_up``'s generate would fail); it also learns the vector's length."""
        warm = PreprocessedRequest(
            rid=f"warmup-{uuid.uuid4().hex}", token_ids=[10, 11, 12, 13], embed=EmbedOptions()
        )
        try:
            with anyio.fail_after(self._warmup_timeout):
                async with aclosing(self._embed_stream(warm).run()) as outputs:
                    async for _ in outputs:
                        pass
        except TimeoutError as exc:
            raise EngineFailure(f"warm-up timed out after {self._warmup_timeout} s") from exc
        except RequestError as exc:
            raise EngineFailure(f"warm-up failed: {exc}") from exc

    def _built(self, engine: Any) -> None:
        self._engine = engine

    async def server_info(self) -> dict[str, Any]:
        """SGLang's current server info (resolved args, scheduler info, internal state)."""
        _, engine = self._require_started()
        self._info = await server_info(engine, self._tm)
        return dict(self._info)

    def note_shutdown_signal(self, signum: int) -> None:
        """Record the signal that started shutdown: cleanup runs its deferred SGLang handlers."""
        self._shutdown_signal = int(signum)

    async def cleanup(self) -> None:
        """Stop in-flight requests, shut SGLang down, restore signals. Idempotent, runs once."""
        if self._cleanup_done is not None:
            await self._cleanup_done.wait()
            return
        self._cleanup_done = anyio.Event()
        try:
            with anyio.CancelScope(shield=True):
                await self._cleanup()
        finally:
            self._cleanup_done.set()

    async def _cleanup(self) -> None:
        self._closing = True
        if self._streams:
            for stream in list(self._streams.values()):
                stream.shutdown()
            with anyio.move_on_after(_SHUTDOWN_DRAIN_S):
                await self.wait_quiescent()
        error = await shutdown_engine(self._engine, self._tm)
        if self._signals is not None:
            self._signals.uninstall()
            if self._shutdown_signal is not None:
                await self._signals.run_deferred(self._shutdown_signal)
        if error is not None:
            raise EngineFailure(f"SGLang shutdown failed: {error!r}") from error

    # ---------------------------------------------------------------------------- requests

    def _require_started(self) -> tuple[SGLangAPI, Any]:
        if self._api is None or self._engine is None or self._tm is None:
            raise RuntimeError("SGLangEngine is not started")
        return self._api, self._engine

    async def generate(self, request: PreprocessedRequest) -> AsyncGenerator[EngineOutput, None]:
        """Stream ``request``'s outputs; closing the iterator early aborts it in SGLang."""
        _, engine = self._require_started()
        if self._closing:
            raise EngineShutdown("the SGLang engine is shutting down")
        if self._released:
            raise WorkerDraining("GPU memory is released; resume it first")
        if request.rid in self._streams:
            raise InvalidRequest(f"request id {request.rid!r} is already running")
        assert self._stream_config is not None
        stream: RequestStream | EmbedStream
        if self.kind == "embedding":
            stream = self._embed_stream(request)
        elif request.embed is not None:
            raise InvalidRequest(f"this engine serves {self.kind} models, not embeddings")
        else:
            stream = RequestStream(self, engine, self._tm, request, self._stream_config)
        self._streams[request.rid] = stream
        try:
            noted = self._early_aborts.pop(request.rid, None)
            if noted is not None and anyio.current_time() - noted < _EARLY_ABORT_TTL_S:
                stream.client_aborted = True  # aborted before it began: never submitted
                yield stream.cancelled_output()
                return
            async with aclosing(stream.run()) as outputs:
                async for output in outputs:
                    yield output
        finally:
            del self._streams[request.rid]
            self._finished_rids[request.rid] = None
            while len(self._finished_rids) > _EARLY_ABORTS_MAX:
                self._finished_rids.popitem(last=False)
            if not self._streams and self._idle is not None:
                self._idle.set()
                self._idle = None

    def _embed_stream(self, request: PreprocessedRequest) -> EmbedStream:
        """An embed request's stream (``InvalidRequest`` for one this model cannot serve)."""
        embed = request.embed
        if embed is None:
            raise InvalidRequest(
                "this engine serves embedding models: the request needs 'embed' options"
            )
        check_dimensions(embed, self._embed_dim)
        if not request.token_ids:
            raise InvalidRequest("token_ids is empty")
        api = self._api
        assert api is not None and self._stream_config is not None
        extra: dict[str, Any] = {}
        if request.traceparent is not None and self._embed_trace_header:
            extra["external_trace_header"] = {"traceparent": request.traceparent}
        obj = api.EmbeddingReqInput(input_ids=list(request.token_ids), rid=request.rid, **extra)
        return EmbedStream(self, self._tm, request, obj, self._stream_config.aborted_errors)

    def learned_dimensions(self, dim: int) -> None:
        """The model's vector length, from an answer (later requests are checked upfront)."""
        self._embed_dim = dim

    async def abort(self, rid: str) -> None:
        """Abort ``rid`` in any phase. Before its ``generate`` began, it will end at once."""
        stream = self._streams.get(rid)
        if stream is None:
            if rid not in self._finished_rids:
                self._early_aborts[rid] = anyio.current_time()
                while len(self._early_aborts) > _EARLY_ABORTS_MAX:
                    self._early_aborts.popitem(last=False)
            return
        await stream.abort()

    @property
    def capacity(self) -> Capacity | None:
        """What ``start`` reported (``None`` before)."""
        return self._capacity

    @property
    def bootstrap_port(self) -> int | None:
        """SGLang's disaggregation bootstrap port (prefill and decode roles)."""
        return self._bootstrap_port

    # Read by RequestStream to tell a client abort from a worker-side one.
    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def paused(self) -> PauseMode | None:
        return self._paused

    def is_quiescent(self) -> bool:
        """No request stream open (a prefill's stream stays open until its KV is sent)."""
        return not self._streams

    async def wait_quiescent(self) -> None:
        """Return once no request stream is open."""
        while self._streams:
            if self._idle is None:
                self._idle = anyio.Event()
            await self._idle.wait()

    # ---------------------------------------------------------------------------- control

    async def pause(self, mode: PauseMode) -> None:
        """SGLang's ``pause_generation``; requests it aborts end with ``WorkerDraining``."""
        api, _ = self._require_started()
        previous, self._paused = self._paused, mode
        try:
            await self._tm.pause_generation(api.PauseGenerationReqInput(mode=mode.value))
        except BaseException:
            self._paused = previous
            raise

    async def continue_generation(self) -> None:
        """SGLang's ``continue_generation``; refused while any memory tag is still released."""
        api, _ = self._require_started()
        if self._released:
            raise RuntimeError(
                f"resume {sorted(t.value for t in self._released)} before continuing generation"
            )
        await self._tm.continue_generation(api.ContinueGenerationReqInput())
        self._paused = None

    async def release_memory(self, tags: Sequence[MemoryTag]) -> None:
        """Release ``tags`` not yet released (others are a no-op). Generation must be paused."""
        api, _ = self._require_started()
        if not self._memory_release:
            raise RuntimeError("memory release needs SGLangEngine(memory_release=True)")
        todo = [t for t in _TAG_ORDER if t in set(tags) and t not in self._released]
        if not todo:
            return
        if self._paused is None:
            raise RuntimeError("pause generation before releasing memory")
        for _ in range(int(_RELEASE_IDLE_WAIT_S / 0.01)):
            if not self._tm.rid_to_state:
                break
            await anyio.sleep(0.01)
        if self._tm.rid_to_state:
            raise EngineFailure(
                f"SGLang still holds {len(self._tm.rid_to_state)} requests; not released"
            )
        await self._tm.release_memory_occupation(
            api.ReleaseMemoryOccupationReqInput(tags=[t.value for t in todo]), None
        )
        self._released.update(todo)

    async def resume_memory(self, tags: Sequence[MemoryTag]) -> None:
        """Resume the released tags among ``tags``; an unreleased tag never reaches SGLang.

        (Resuming a tag SGLang did not release raises ``KeyError`` inside its scheduler and can
        crash it: Dynamo PR #6967.) Generation stays paused: ``continue_generation`` follows once
        every released tag is back.
        """
        api, _ = self._require_started()
        todo = [t for t in _TAG_ORDER if t in set(tags) and t in self._released]
        if not todo:
            return
        await self._tm.resume_memory_occupation(
            api.ResumeMemoryOccupationReqInput(tags=[t.value for t in todo]), None
        )
        self._released.difference_update(todo)

    def released_tags(self) -> frozenset[MemoryTag]:
        return frozenset(self._released)

    async def flush_cache(self) -> bool:
        """Flush SGLang's prefix cache; ``False`` when SGLang refused (requests running)."""
        self._require_started()
        result = await self._tm.flush_cache()
        return bool(getattr(result, "success", result))

    def health_payload(self) -> PreprocessedRequest:
        """The role's minimal canary (Dynamo's payloads): one token, ``max_tokens`` 1.

        Prefill and decode carry SGLang's fake bootstrap host with this worker's bootstrap port
        and room 0, so SGLang skips the KV transfer.
        """
        bootstrap = None
        if self.role != "aggregated":
            api, _ = self._require_started()
            assert self._bootstrap_port is not None
            bootstrap = BootstrapInfo(
                host=api.FAKE_BOOTSTRAP_HOST, port=self._bootstrap_port, room=0
            )
        if self.kind == "embedding":
            return PreprocessedRequest(
                rid=f"health-{uuid.uuid4().hex}",
                token_ids=[self._bos if self._bos is not None else 1],
                embed=EmbedOptions(),
                health_check=True,
            )
        return PreprocessedRequest(
            rid=f"health-{uuid.uuid4().hex}",
            token_ids=[self._bos if self._bos is not None else 1],
            stop_conditions=StopConditions(max_tokens=1, ignore_eos=False),
            sampling_options=SamplingOptions(temperature=0.0, top_p=1.0, top_k=-1),
            bootstrap_info=bootstrap,
            routing=RoutingHints(),
            health_check=True,
        )

    def statistics(self) -> SGLangEngineStatistics:
        return SGLangEngineStatistics(
            role=self.role,
            started=self._engine is not None,
            closed=self._cleanup_done is not None and self._cleanup_done.is_set(),
            # Ours and SGLang's own (its tokenizer manager's registry): an aborted request counts
            # until SGLang has really let it go.
            in_flight=len(self._streams.keys() | (self._tm.rid_to_state if self._tm else {})),
            paused=None if self._paused is None else self._paused.value,
            released=frozenset(self._released),
            deferred_signals=self._signals.captured() if self._signals is not None else {},
        )


class EmbedStream:
    """One embed request through SGLang's tokenizer manager: one answer, then the end.

    An abort (or shutdown) aborts the request in SGLang when it was dispatched and stops waiting
    for the answer at once; closing SGLang's generator makes it drop an undispatched one locally.
    """

    def __init__(
        self,
        owner: SGLangEngine,
        tm: Any,
        request: PreprocessedRequest,
        obj: Any,
        aborted_errors: tuple[type[Exception], ...],
    ) -> None:
        self.rid = request.rid
        self.client_aborted = False
        self._owner, self._tm, self._request = owner, tm, request
        self._obj = obj  # SGLang's EmbeddingReqInput
        self._aborted_errors = aborted_errors
        self._prompt = len(request.token_ids)
        self._scope: anyio.CancelScope | None = None
        self._stopped = False  # abort or shutdown: stop waiting for the answer
        self._shutdown = False
        self._finished = False

    def cancelled_output(self) -> EngineOutput:
        """The terminal output of a client-cancelled request."""
        usage = Usage(prompt_tokens=self._prompt, completion_tokens=0)
        return EngineOutput(finish_reason="cancelled", usage=usage)

    async def run(self) -> AsyncGenerator[EngineOutput, None]:
        """The one output: the vector, or ``cancelled``; typed errors otherwise."""
        gen: Any = None
        try:
            with anyio.CancelScope() as scope:
                self._scope = scope
                if self._stopped:
                    scope.cancel()
                gen = self._tm.generate_request(self._obj, None)
                answer = await self._answer(gen)
            self._scope = None
            if scope.cancelled_caught or answer is None:
                yield self._stopped_output()
                return
            self._finished = True
            yield self._output(answer)
        finally:
            await self._close(gen)

    async def _answer(self, gen: Any) -> Any:
        """SGLang's one answer; ``None`` when an abort or a shutdown stopped it."""
        try:
            return await gen.__anext__()
        except StopAsyncIteration as exc:
            if self._stopped:
                return None
            raise StreamIncomplete("SGLang's embedding stream ended without an answer") from exc
        except RequestError:
            raise
        except self._aborted_errors:
            return None if self.client_aborted else self._raise_worker_abort("aborted")
        except ValueError as exc:  # SGLang's validation (too long, not an embedding model, ...)
            if self._stopped or self._owner.paused is not None:
                return None if self.client_aborted else self._raise_worker_abort(str(exc))
            raise InvalidRequest(str(exc)) from exc
        except Exception as exc:
            raise EngineFailure(f"SGLang's embedding request failed: {exc!r}") from exc

    def _output(self, answer: Mapping[str, Any]) -> EngineOutput:
        meta = answer.get("meta_info") or {}
        reason = meta.get("finish_reason")
        raw = reason.get("type") if isinstance(reason, Mapping) else reason
        if isinstance(raw, str) and raw.startswith("abort"):
            if self.client_aborted:
                return self.cancelled_output()
            message = str(reason.get("message") or "") if isinstance(reason, Mapping) else ""
            self._raise_worker_abort(message, reason)
        embedding = answer.get("embedding")
        if embedding is None:
            raise EngineFailure("SGLang's answer has no embedding")
        vector = np.asarray(embedding, dtype="<f4").reshape(-1)
        self._owner.learned_dimensions(len(vector))
        embed = self._request.embed
        dims = embed.dimensions if embed is not None else None
        if dims is not None and dims != len(vector):
            raise wrong_dimensions(dims, len(vector))
        usage = Usage(
            prompt_tokens=int(meta.get("prompt_tokens", self._prompt)), completion_tokens=0
        )
        return EngineOutput(embedding=vector.tobytes(), finish_reason="stop", usage=usage)

    def _stopped_output(self) -> EngineOutput:
        if self.client_aborted:
            self._finished = True
            return self.cancelled_output()
        raise stopped_error(self._owner, "embedding request", shutdown=self._shutdown)

    def _raise_worker_abort(self, message: str, reason: Any = None) -> NoReturn:
        """Raise the error of an abort the client did not ask for (never "cancelled")."""
        self._finished = True
        raise worker_abort_error(self._owner, message, reason, shutdown=self._shutdown)

    def _abort_in_sglang(self) -> None:
        """Abort the request in SGLang's scheduler if it reached it."""
        state = self._tm.rid_to_state.get(self.rid)
        if state is not None and dispatched(state) is not False:
            self._tm.abort_request(rid=self.rid)

    def _stop(self) -> None:
        self._stopped = True
        self._abort_in_sglang()
        if self._scope is not None:
            self._scope.cancel()

    async def abort(self) -> None:
        """The client's abort: the stream ends ``cancelled`` at once."""
        self.client_aborted = True
        if not self._finished:
            self._stop()

    def shutdown(self) -> None:
        """The engine shuts down: the stream ends in ``EngineShutdown``."""
        self._shutdown = True
        if not self._finished:
            self._stop()

    async def _close(self, gen: Any) -> None:
        """Leave nothing behind in SGLang: abort an unanswered request, close the generator."""
        with anyio.CancelScope(shield=True):
            if not self._finished and not self._stopped:
                self._abort_in_sglang()
            aclose = getattr(gen, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:  # already failed; its error was reported by the stream
                    pass


if TYPE_CHECKING:

    def _conforms(engine: SGLangEngine) -> Engine:
        return engine  # mypy checks SGLangEngine against the engine contract
