"""``MockEngine``: the engine contract over per-rank schedulers, KV memory and publishers.

Tasks: one scheduler loop and one replay server per data-parallel rank. They run in the task
group given to the constructor, or in the engine's own when it is used as ``async with engine``;
``cleanup`` cancels them and waits for them, so no task outlives the engine.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType

import anyio
import anyio.abc
import anyio.to_thread
import msgspec

from actors.serving.engines._grammar import generated_tail
from actors.serving.engines._mock._config import (
    FAKE_BOOTSTRAP_HOST,
    EngineRole,
    MockEngineConfig,
    offset_endpoint,
)
from actors.serving.engines._mock._dllm import dllm_state
from actors.serving.engines._mock._embed import EmbedStream, check_embed
from actors.serving.engines._mock._image import ImageJobs, mock_image_canary
from actors.serving.engines._mock._kvmem import (
    HostOrDeviceBuffer,
    KvPageMemory,
    resolve_device,
)
from actors.serving.engines._mock._publish import KvEventPublisher, MetricsPublisher
from actors.serving.engines._mock._request import EngineStream, MockRequest, Phase
from actors.serving.engines._mock._scheduler import RankScheduler
from actors.serving.engines._mock._stats import IntrospectionMixin
from actors.serving.engines._mock._steer import Steering, mock_vocabulary
from actors.serving.engines._mock._tokens import TokenModel
from actors.serving.engines._mock._transfer import TransferMixin
from actors.serving.errors import MockEngineBusy
from protocols.engine import (
    BootstrapInfo,
    Capacity,
    EmbedOptions,
    MemoryTag,
    PauseMode,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from protocols.errors import (
    ContextLengthExceeded,
    EngineShutdown,
    InvalidRequest,
    KVTransferError,
    RequestError,
)

__all__ = ["MockEngine", "MockEngineBusy"]

_CLEANUP_WAIT_S = 5.0


class MockEngine(TransferMixin, IntrospectionMixin):
    """A simulated SGLang engine (see the package docstring); implements ``protocols.Engine``."""

    def __init__(
        self,
        config: MockEngineConfig | None = None,
        *,
        task_group: anyio.abc.TaskGroup | None = None,
    ) -> None:
        self.config = cfg = config or MockEngineConfig()
        self._tg = task_group
        self._own_tg: anyio.abc.TaskGroup | None = None
        self._tokens = TokenModel(cfg.vocab_size, cfg.eos_token_id, cfg.eos_rate)
        self._device = "cpu"
        self._ranks: list[RankScheduler] = []
        self._memories: list[KvPageMemory] = []
        self._event_pubs: list[KvEventPublisher] = []
        self._metrics_pub: MetricsPublisher | None = None
        self._weights: HostOrDeviceBuffer | None = None
        self._graphs: HostOrDeviceBuffer | None = None
        self._requests: dict[str, MockRequest] = {}
        self._images = ImageJobs(cfg, self._image_ended)  # kind "image": beside the scheduler
        self._quiet_waiters: list[anyio.Event] = []
        self._released: set[MemoryTag] = set()
        self._capacity: Capacity | None = None
        self._state = "new"  # new -> starting -> running -> closed
        self._scopes: list[anyio.CancelScope] = []
        self._tasks_left = 0
        self._tasks_done: anyio.Event | None = None
        self._cleanup_done: anyio.Event | None = None
        self.cleanup_runs = 0  # how many times cleanup did its work (always 0 or 1)

    # -- context manager: an engine-owned task group ---------------------------------------

    async def __aenter__(self) -> MockEngine:
        self._own_tg = anyio.create_task_group()
        await self._own_tg.__aenter__()
        self._tg = self._own_tg
        try:
            await self.start()
        except BaseException as exc:
            await self.cleanup()
            await self._own_tg.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        await self.cleanup()
        assert self._own_tg is not None
        # Our tasks are gone: exit the group on its own so the body's exception (if any)
        # propagates as is, not wrapped in an exception group.
        await self._own_tg.__aexit__(None, None, None)
        return None

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> Capacity:
        """Allocate memory, bind the publishers, start the schedulers; returns the capacity."""
        if self._state != "new":
            raise RuntimeError(f"MockEngine.start: engine is {self._state}")
        if self._tg is None:
            raise RuntimeError("MockEngine needs task_group=... or 'async with MockEngine(...)'")
        self._state = "starting"
        cfg = self.config
        try:
            if cfg.fail_start_file is not None:
                _injected_start_failure(cfg.fail_start_file)
            self._device = resolve_device(cfg.device)
            self._memories = [
                KvPageMemory(rank, cfg.num_blocks, cfg.kv_bytes_per_block, self._device)
                for rank in range(cfg.dp_size)
            ]
            # Committing (and filling) GBs takes a while: keep it off the event loop.
            await anyio.to_thread.run_sync(self._allocate, set(MemoryTag))
            if cfg.metrics_endpoint is not None:
                self._metrics_pub = MetricsPublisher(cfg.metrics_endpoint)
            for rank, memory in enumerate(self._memories):
                events = None
                if cfg.kv_events_endpoint is not None:
                    replay = cfg.kv_events_replay_endpoint
                    events = KvEventPublisher(
                        rank,
                        offset_endpoint(cfg.kv_events_endpoint, rank),
                        offset_endpoint(replay, rank) if replay is not None else None,
                        topic=cfg.kv_events_topic,
                        buffer_steps=cfg.kv_events_buffer_steps,
                        hwm=cfg.kv_events_hwm,
                    )
                    self._event_pubs.append(events)
                metrics = self._metrics_pub.publish if self._metrics_pub is not None else None
                sched = RankScheduler(rank, cfg, self._tokens, memory, events, metrics, self._ended)
                self._ranks.append(sched)
            self._tasks_done = anyio.Event()
            for sched in self._ranks:
                await self._spawn(sched.run)
            for pub in self._event_pubs:
                await self._spawn(pub.serve_replay)
        except BaseException:
            await self.cleanup()
            raise
        self._state = "running"
        self._capacity = Capacity(
            total_kv_blocks=cfg.num_blocks,
            block_size=cfg.block_size,
            max_running_requests=cfg.max_running_requests,
            max_batch_tokens=cfg.max_batch_tokens,
            context_length=cfg.context_length,
            dp_size=cfg.dp_size,
            bootstrap=BootstrapInfo(host=cfg.bootstrap_host, port=cfg.bootstrap_port, room=0)
            if cfg.role == "prefill"
            else None,
            kv_events_endpoints=tuple(p.endpoint for p in self._event_pubs),
            kv_events_replay_endpoints=tuple(
                p.replay_endpoint for p in self._event_pubs if p.replay_endpoint is not None
            ),
            metrics_endpoint=self._metrics_pub.endpoint if self._metrics_pub else None,
            prefills_alone=cfg.prefills_alone,
        )
        return self._capacity

    def slow_down(self, factor: float) -> None:
        """Fault injection (a slow engine): every step from the next one on takes ``factor`` times
        as long as configured (1 restores the configured speed)."""
        if not factor > 0:
            raise ValueError("factor must be > 0")
        base = self.config.timing
        timing = msgspec.structs.replace(base, speedup=base.speedup / factor)
        slowed = msgspec.structs.replace(self.config, timing=timing)
        for sched in self._ranks:
            sched.cfg = slowed  # the scheduler reads its config's timing at every step
        self._images.cfg = slowed  # so do image requests

    async def _spawn(self, fn: Callable[[], Awaitable[None]]) -> None:
        async def task(*, task_status: anyio.abc.TaskStatus[None]) -> None:
            with anyio.CancelScope() as scope:
                self._scopes.append(scope)
                self._tasks_left += 1
                task_status.started()
                try:
                    await fn()
                finally:
                    self._tasks_left -= 1
                    if self._tasks_left == 0 and self._tasks_done is not None:
                        self._tasks_done.set()

        assert self._tg is not None
        await self._tg.start(task)

    async def cleanup(self) -> None:
        """End every request (``EngineShutdown``), stop the tasks, close sockets, free memory.

        Idempotent: the work runs exactly once; later or concurrent calls wait for it.
        """
        if self._cleanup_done is not None:
            await self._cleanup_done.wait()
            return
        self._cleanup_done = anyio.Event()
        self._state = "closed"
        try:
            with anyio.CancelScope(shield=True):
                shutdown = EngineShutdown("the engine shut down")
                self._images.shutdown(shutdown)
                for sched in self._ranks:
                    sched.closed = True
                    for req in [*sched.waiting, *sched.running, *sched.owed.values()]:
                        sched.end(req, error=shutdown)
                for scope in self._scopes:
                    scope.cancel()
                if self._tasks_left and self._tasks_done is not None:
                    with anyio.move_on_after(_CLEANUP_WAIT_S):
                        await self._tasks_done.wait()
                for pub in self._event_pubs:
                    pub.close()
                if self._metrics_pub is not None:
                    self._metrics_pub.close()
                for memory in self._memories:
                    memory.free()
                for buf in (self._weights, self._graphs):
                    if buf is not None:
                        buf.free()
        finally:
            self.cleanup_runs += 1
            self._cleanup_done.set()

    # -- requests -----------------------------------------------------------------------------

    def generate(self, request: PreprocessedRequest) -> EngineStream:
        """Submit ``request`` now (so ``abort(rid)`` reaches it at once) and stream its outputs."""
        if self.config.kind == "image" or request.image is not None:
            return self._images.generate(request, running=self._state == "running")
        try:
            req = self._admit(request)
        except RequestError as exc:
            return EngineStream(None, None, error=exc)
        if request.embed is not None:
            return EmbedStream(req, self._ranks[req.rank], dim=self.config.embedding_dim)
        return EngineStream(req, self._ranks[req.rank])

    def _admit(self, request: PreprocessedRequest) -> MockRequest:
        cfg = self.config
        if self._state != "running":
            raise EngineShutdown(f"the engine is {self._state}")
        check_embed(request, cfg.kind, cfg.embedding_dim)
        n = len(request.token_ids)
        if n == 0:
            raise InvalidRequest("token_ids is empty")
        if request.rid in self._requests:
            raise InvalidRequest(f"request {request.rid!r} is already in flight")
        cap = min(cfg.context_length, cfg.num_blocks * cfg.block_size)
        if n >= cap:
            raise ContextLengthExceeded(f"{n} prompt tokens; the limit is {cap - 1}")
        rank = self._pick_rank(request)
        sc, so = request.stop_conditions, request.sampling_options
        max_new = cap - n if sc.max_tokens is None else min(max(sc.max_tokens, 0), cap - n)
        if request.embed is not None:
            max_new = 0  # an embedding is the prompt's forward pass alone
        stop = set(sc.stop_token_ids or ())
        if not sc.ignore_eos:
            stop.update(request.eos_token_ids or (cfg.eos_token_id,))
        greedy = so.temperature == 0.0 or so.top_k == 1
        seed = so.seed if so.seed is not None else cfg.default_seed
        bootstrap = request.bootstrap_info
        if bootstrap is None and cfg.role == "decode" and not cfg.prefills_alone:
            raise InvalidRequest("a decode worker needs the request's bootstrap_info")
        if bootstrap is not None and (
            bootstrap.host == FAKE_BOOTSTRAP_HOST or cfg.role == "aggregated"
        ):
            bootstrap = None  # SGLang's fake host: no transfer (warm-up, canaries)
        req = MockRequest(
            request,
            rank,
            max_new=max_new,
            min_new=sc.min_tokens or 0,
            stop=frozenset(stop),
            seed_word=self._tokens.seed_word(seed, greedy),
            bootstrap=bootstrap,
        )
        if bootstrap is not None and cfg.role == "decode":
            req.prompt_logprobs_due = False  # the prefill worker computed the prompt: its own
        if Steering.wanted(request):
            req.steer = self._steering(request, req.stop)
        req.dllm = dllm_state(cfg, request)
        sched = self._ranks[rank]
        if bootstrap is not None:
            req.transfer_ready = anyio.Event()
            if request.live_migration and cfg.role == "decode" and not sched.admit_now(req):
                raise KVTransferError(f"{req.rid}: no room for the migrated KV")
        self._requests[req.rid] = req
        if req.phase is Phase.WAITING:
            sched.submit(req)
        return req

    def _steering(self, request: PreprocessedRequest, stop: frozenset[int]) -> Steering:
        """How ``request`` chooses its tokens (InvalidRequest for a grammar that is not one)."""
        cfg = self.config
        grammar = request.sampling_options.guided_decoding
        matcher = None
        if grammar is not None:
            vocab = mock_vocabulary(cfg.vocab_size, cfg.eos_token_id)
            matcher = vocab.matcher(grammar, generated_tail(request))
        return Steering(
            request,
            vocab_size=cfg.vocab_size,
            eos_token_id=cfg.eos_token_id,
            stop=stop,
            matcher=matcher,
        )

    def _pick_rank(self, request: PreprocessedRequest) -> int:
        hint = request.routing.dp_rank if request.routing is not None else None
        if hint is not None:
            if not 0 <= hint < self.config.dp_size:
                raise InvalidRequest(f"dp_rank {hint} outside [0, {self.config.dp_size})")
            return hint
        return min(range(len(self._ranks)), key=lambda r: (*self._ranks[r].load(), r))

    def _ended(self, req: MockRequest) -> None:
        if self._requests.get(req.rid) is req:
            del self._requests[req.rid]
        if self._quiet_waiters:
            # Woken on every end; ``wait_quiescent`` re-checks (the scheduler may still be
            # tidying its queues at this point).
            waiters, self._quiet_waiters = self._quiet_waiters, []
            for event in waiters:
                event.set()

    def _image_ended(self) -> None:
        waiters, self._quiet_waiters = self._quiet_waiters, []
        for event in waiters:
            event.set()

    @property
    def images(self) -> ImageJobs:
        """The image requests (``kind="image"``) and their statistics."""
        return self._images

    def _find(self, rid: str) -> MockRequest | None:
        req = self._requests.get(rid)
        if req is None:
            for sched in self._ranks:
                req = sched.owed.get(rid)
                if req is not None:
                    break
        return req

    async def abort(self, rid: str) -> None:
        """Abort ``rid`` in any phase (queued, prefilling, decoding, awaiting or owing KV): its
        stream ends with ``cancelled`` and its blocks are freed before this returns."""
        if self._images.abort(rid):
            return
        req = self._find(rid)
        if req is not None:
            self._ranks[req.rank].end(req)

    # -- control ------------------------------------------------------------------------------

    async def pause(self, mode: PauseMode) -> None:
        """SGLang's ``pause_generation``; returns once no step is in flight."""
        self._images.pause(mode)
        for sched in self._ranks:
            sched.pause(mode)
        for sched in self._ranks:
            await sched.wait_step_boundary()

    async def continue_generation(self) -> None:
        self._images.resume()
        for sched in self._ranks:
            sched.resume()

    async def release_memory(self, tags: Sequence[MemoryTag]) -> None:
        """Free the memory of ``tags`` (already released tags are skipped)."""
        todo = set(tags) - self._released
        if MemoryTag.KV_CACHE in todo:
            if any(s.holds_kv() for s in self._ranks):
                raise MockEngineBusy("requests hold KV: pause (retract or abort) first")
            for sched in self._ranks:
                sched.pool.reset()
                sched.flush_events()
                sched.memory.free()
        if MemoryTag.WEIGHTS in todo and self._weights is not None:
            self._weights.free()
            self._weights = None
        if MemoryTag.CUDA_GRAPH in todo and self._graphs is not None:
            self._graphs.free()
            self._graphs = None
        self._released |= todo
        self._update_ready()

    async def resume_memory(self, tags: Sequence[MemoryTag]) -> None:
        """Re-allocate the memory of ``tags``; resuming a tag that is not released is a no-op."""
        todo = set(tags) & self._released
        if todo:
            await anyio.to_thread.run_sync(self._allocate, todo)
        self._released -= todo
        self._update_ready()

    def _allocate(self, tags: set[MemoryTag]) -> None:
        """Allocate (and fill, for the weights) the memory of ``tags`` (in a worker thread)."""
        cfg = self.config
        if MemoryTag.KV_CACHE in tags:
            for memory in self._memories:
                memory.allocate()
        if MemoryTag.WEIGHTS in tags:
            self._weights = HostOrDeviceBuffer(cfg.weights_bytes, self._device)
            self._weights.fill_pattern(cfg.default_seed)  # "loading" commits the pages
        if MemoryTag.CUDA_GRAPH in tags:
            self._graphs = HostOrDeviceBuffer(cfg.cuda_graph_bytes, self._device)

    def _update_ready(self) -> None:
        ready = not self._released & {MemoryTag.KV_CACHE, MemoryTag.WEIGHTS}
        for sched in self._ranks:
            sched.memory_ready = ready
            sched.wake()

    @property
    def released_tags(self) -> frozenset[MemoryTag]:
        return frozenset(self._released)

    @property
    def role(self) -> EngineRole:
        return self.config.role

    async def flush_cache(self) -> bool:
        """Drop the prefix cache; ``False`` (nothing done) while any request holds KV."""
        if any(s.holds_kv() for s in self._ranks):
            return False
        for sched in self._ranks:
            sched.pool.flush()
            sched.flush_events()
        return True

    def is_quiescent(self) -> bool:
        """No request queued, running, awaiting KV or owing KV (on any rank)."""
        return self._images.idle() and all(s.idle() for s in self._ranks)

    async def wait_quiescent(self) -> None:
        """Return once ``is_quiescent`` (a drain: owed KV transfers included)."""
        while not self.is_quiescent():
            event = anyio.Event()
            self._quiet_waiters.append(event)
            await event.wait()

    def health_payload(self) -> PreprocessedRequest:
        """The role's canary: one token, ``max_tokens`` 1, greedy; prefill adds the fake host."""
        cfg = self.config
        if cfg.kind == "image":
            return mock_image_canary()
        prefill = cfg.role == "prefill"
        return PreprocessedRequest(
            rid=f"health-{uuid.uuid4().hex}",
            token_ids=[cfg.bos_token_id],
            stop_conditions=StopConditions(max_tokens=1, ignore_eos=False),
            sampling_options=SamplingOptions(temperature=0.0, top_p=1.0, top_k=-1),
            eos_token_ids=[],
            bootstrap_info=BootstrapInfo(host=FAKE_BOOTSTRAP_HOST, port=cfg.bootstrap_port, room=0)
            if prefill
            else None,
            health_check=prefill,
            embed=EmbedOptions() if cfg.kind == "embedding" else None,
        )

    @property
    def capacity(self) -> Capacity:
        if self._capacity is None:
            raise RuntimeError("the engine has not started")
        return self._capacity


def _injected_start_failure(path: str) -> None:
    """Fail this start if the count in ``path`` is still > 0 (and count it down)."""
    try:
        with open(path) as f:
            left = int(f.read().strip() or 0)
    except FileNotFoundError:
        return
    if left > 0:
        with open(path, "w") as f:
            f.write(str(left - 1))
        raise RuntimeError(f"injected start failure ({left - 1} more to come)")
