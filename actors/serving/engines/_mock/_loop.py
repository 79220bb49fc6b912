"""The step loop of a rank, its reader wake-ups and its load metrics (a mixin of the scheduler).

Timed mode sleeps each step's simulated time against a virtual clock: a step starts when the
previous one was due to end, not when the loop woke up, so sleep lateness never accumulates (the
clock re-anchors after an idle period, or when the loop falls more than ``_MAX_LAG_S`` behind).
Instant mode runs steps back to back and yields to the event loop every ``instant_yield_s`` (or at
once after a first or last token), waking readers in batches.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import anyio
import anyio.lowlevel
import msgspec

from actors.serving.engines._mock._batch import DecodeBatch
from actors.serving.engines._mock._config import MockEngineConfig
from actors.serving.engines._mock._pool import BlockPool
from actors.serving.engines._mock._received import ReceivedPages
from actors.serving.engines._mock._request import MockRequest, Phase
from protocols.engine import FinishReason
from protocols.errors import KVTransferError, RequestError
from protocols.kv_events import KvMetrics

__all__ = ["LoopMixin", "Step", "StepRecord"]

# Further behind the virtual clock than this (a stalled process): stop catching up, re-anchor.
_MAX_LAG_S = 1.0

# What waking one reader costs (a task switch and an output), to pace instant-mode yields.
_READER_WAKE_S = 50e-6

# (prefill chunks, decode slots below this bound, seconds, prefill tokens, decoders, KV fraction)
Step = tuple[list[tuple[MockRequest, int]], int, float, int, int, float]


class StepRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One step (kept when ``record_steps`` is on): what the timing model was given, what it
    charged, and when (``anyio.current_time()``) the step was due to start and was committed."""

    prefill_tokens: int
    decode_requests: int
    kv_fraction: float
    seconds: float
    started: float
    committed: float


class LoopMixin:
    """``run`` and friends; the scheduler provides the state and ``_plan`` / ``_commit``."""

    rank: int
    cfg: MockEngineConfig
    pool: BlockPool
    batch: DecodeBatch
    waiting: deque[MockRequest]
    running: list[MockRequest]
    owed: dict[str, MockRequest]
    paused: bool
    holds: int
    memory_ready: bool
    prompt_tokens: int
    cached_tokens: int
    _publish_metrics: Callable[[KvMetrics], None] | None
    _deferred: list[MockRequest]
    _unprepared: list[MockRequest]
    _arrived: list[MockRequest]
    _gather_until: float | None
    received: ReceivedPages
    _readers: list[MockRequest]
    _urgent: bool
    _wake_event: anyio.Event | None
    _step_done: anyio.Event | None
    _clock: float | None
    _metrics_sent: tuple[int, ...] | None
    _metrics_at: float
    records: list[StepRecord]

    def _plan(self) -> Step | None:
        raise NotImplementedError

    def _commit(self, step: Step) -> None:
        raise NotImplementedError

    def flush_events(self) -> None:
        raise NotImplementedError

    def prepare_transfers(self) -> None:
        raise NotImplementedError

    def end(
        self,
        req: MockRequest,
        reason: FinishReason = "cancelled",
        error: RequestError | None = None,
    ) -> None:
        raise NotImplementedError

    # -- metrics --------------------------------------------------------------------------

    def metrics(self) -> KvMetrics:
        total, used, prompt = self.cfg.num_blocks, self.pool.used, self.prompt_tokens
        return KvMetrics(
            request_active_slots=len(self.running),
            request_total_slots=self.cfg.max_running_requests,
            kv_active_blocks=used,
            kv_total_blocks=total,
            num_requests_waiting=len(self.waiting),
            gpu_cache_usage_perc=used / total,
            gpu_prefix_cache_hit_rate=self.cached_tokens / prompt if prompt else 0.0,
            data_parallel_rank=self.rank,
        )

    def _metrics_key(self) -> tuple[int, ...]:
        return (len(self.running), self.pool.used, len(self.waiting), self.cached_tokens)

    def publish_metrics(self, force: bool = False) -> None:
        """Publish if the state changed (at most once per ``metrics_interval_s``) or forced."""
        if self._publish_metrics is None:
            return
        key = self._metrics_key()
        now = time.monotonic()
        if force or (
            key != self._metrics_sent and now - self._metrics_at >= self.cfg.metrics_interval_s
        ):
            self._metrics_sent, self._metrics_at = key, now
            self._publish_metrics(self.metrics())

    # -- readers --------------------------------------------------------------------------

    def _wake_readers(self) -> None:
        readers, self._readers = self._readers, []
        for req in readers:
            if req.waiter is None:
                continue  # woken already
            if req.phase is Phase.DECODE or req.done:
                req.wake()
            else:
                self._readers.append(req)
        self._urgent = False

    async def wait_step_boundary(self) -> None:
        """Return once no step is in flight."""
        if self._step_done is not None:
            await self._step_done.wait()

    # -- live migrations arriving together ---------------------------------------------------

    def arrived(self, req: MockRequest) -> None:
        """``req`` (a live migration) has its KV here: see :meth:`_gather`."""
        if req.phase is Phase.DECODE:
            self._arrived.append(req)

    def stepped(self) -> None:
        """A decode step ran: every request in the batch has stepped here."""
        self._arrived.clear()
        self._gather_until = None

    def _gather(self, decoders: int) -> bool:
        """Whether to hold back a step that would decode only live migrations that just
        arrived while the KV of more of them (a drain's) is still on its way: so they start
        together, instead of the late ones waiting out a step run for the first few. The
        first wait at most as long as the step they all take together, their KV counted (a step
        started without the late ones makes them wait up to its length, then their own)."""
        arrived = self._arrived = [r for r in self._arrived if r.phase is Phase.DECODE]
        if len(arrived) < decoders or not any(
            r.phase is Phase.AWAITING_KV and r.request.live_migration for r in self.running
        ):
            self._gather_until = None
            return False
        now = anyio.current_time()
        if self._gather_until is None:
            cfg = self.cfg
            together = cfg.timing.step_seconds(0, True, self.pool.used / cfg.num_blocks)
            self._gather_until = now + together
        if now < self._gather_until:
            return True
        self._gather_until = None
        return False

    # -- the loop -------------------------------------------------------------------------

    def _expire(self) -> float:
        """End transfers past their deadline; returns the next deadline (inf if none)."""
        now, nearest = anyio.current_time(), float("inf")
        for req in [*self.owed.values(), *self.running]:
            if req.phase not in (Phase.OWED, Phase.AWAITING_KV):
                continue
            if req.deadline > now:
                nearest = min(nearest, req.deadline)
            elif req.phase is Phase.OWED:
                self.end(req)
            else:
                self.end(req, error=KVTransferError(f"{req.rid}: no KV within the timeout"))
        return nearest

    async def _idle(self) -> None:
        self._clock = None
        self._wake_readers()
        self.publish_metrics(force=self._metrics_sent != self._metrics_key())  # the final state
        timeout = self.cfg.metrics_heartbeat_s
        if self.owed or any(r.phase is Phase.AWAITING_KV for r in self.running):
            timeout = min(timeout, max(0.0, self._expire() - anyio.current_time()))
        gather = self._gather_until
        if gather is not None and gather > anyio.current_time():
            timeout = min(timeout, gather - anyio.current_time())
        assert self._wake_event is not None
        with anyio.move_on_after(timeout) as scope:
            await self._wake_event.wait()
        if scope.cancelled_caught:
            self.publish_metrics(force=True)  # a heartbeat, for late subscribers

    async def run(self) -> None:
        """The step loop; runs until cancelled."""
        cfg, timing = self.cfg, self.cfg.timing
        last_yield = time.perf_counter()
        while True:
            self._wake_event = anyio.Event()
            if self._unprepared:
                self.prepare_transfers()
            if self._deferred:
                deferred, self._deferred = self._deferred, []
                for req in deferred:
                    self.end(req)
            ready = not self.paused and not self.holds and self.memory_ready
            step = self._plan() if ready else None
            if step is None:
                if self._gather_until is None:  # else the step they gather for checks them
                    self.received.check_pending()
                self.flush_events()  # what calls since the last turn left to it (after_change)
                if self._unprepared:
                    # Admitted by this plan (a prefill's KV on its way): the next turn works
                    # out what it must hold, once their callers have asked for it.
                    await anyio.lowlevel.checkpoint()
                    continue
                await self._idle()
                continue
            if timing.instant:
                self.received.check_pending()
                self.flush_events()
                self._commit(step)
                if cfg.record_steps:
                    self._record(step, anyio.current_time())
                # Yield once the readers' wake-ups would cost at most about as much as the
                # steps run meanwhile: each reader then gets many tokens per wake-up.
                budget = max(cfg.instant_yield_s, len(self._readers) * _READER_WAKE_S)
                if time.perf_counter() - last_yield >= budget:
                    self._wake_readers()
                    self.publish_metrics()
                    last_yield = time.perf_counter()
                elif self._urgent:
                    # First or last tokens were handed to their (already woken) readers: let
                    # them run now; the other readers keep collecting tokens.
                    self._urgent = False
                else:
                    continue
                # Two turns: one for the readers, one for what they pass the tokens on to (a
                # process actor's link sends a stream's batch the turn after its producer
                # yields); with one, the steps run meanwhile would hold a first token back for
                # up to instant_yield_s.
                await anyio.lowlevel.checkpoint()
                await anyio.lowlevel.checkpoint()
                continue
            now = anyio.current_time()
            clock = self._clock
            start = clock if clock is not None and now - clock < _MAX_LAG_S else now
            end = start + step[2]
            self._step_done = anyio.Event()
            self.batch.frozen = True
            # While the step runs (as a real engine's CPU works while its GPU computes): the
            # check of received pages left to it, and what calls since the last turn left to
            # publish (a drain's contexts landing together need delay neither their step nor,
            # by their KV events, the step they all join).
            self.received.check_pending()
            self.flush_events()
            try:
                await anyio.sleep(max(0.0, end - anyio.current_time()))
            finally:
                self._step_done.set()
                self._step_done = None
            self._clock = end
            self._commit(step)
            if cfg.record_steps:
                self._record(step, start)
            self._wake_readers()
            self.publish_metrics()

    def _record(self, step: Step, started: float) -> None:
        _, _, seconds, prefill, decode, frac = step
        self.records.append(
            StepRecord(
                prefill_tokens=prefill,
                decode_requests=decode,
                kv_fraction=frac,
                seconds=seconds,
                started=started,
                committed=anyio.current_time(),
            )
        )
