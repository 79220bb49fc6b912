"""One data-parallel rank's continuous-batching scheduler.

Each step: give decode requests that filled their last block a new one (retracting the newest
running request when none is left, as SGLang does under memory pressure), continue chunked
prefills, admit waiting requests FCFS while slots, token budget (``max_batch_tokens``, decode
tokens included) and blocks allow (prefix cache first), then run the step: sleep the timing
model's time against a virtual clock (so wake-up lateness never accumulates) and commit. Requests
join and leave only between steps; one that is aborted or retracted while a step is in flight is
skipped when the step commits.

The loop itself (timing, yields, reader wake-ups, metrics) is ``LoopMixin``.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence

import anyio
import numpy as np

from actors.serving.engines._mock._batch import DecodeBatch
from actors.serving.engines._mock._config import MockEngineConfig
from actors.serving.engines._mock._dllm import step_seconds
from actors.serving.engines._mock._kvmem import KvPageMemory
from actors.serving.engines._mock._loop import LoopMixin, Step, StepRecord
from actors.serving.engines._mock._pages import expected_kv, fill_pages, hashes_upto, write_partials
from actors.serving.engines._mock._pool import BlockPool
from actors.serving.engines._mock._publish import KvEventPublisher
from actors.serving.engines._mock._received import ReceivedPages
from actors.serving.engines._mock._request import MockRequest, Phase
from actors.serving.engines._mock._steer import Steering
from actors.serving.engines._mock._tokens import TokenModel
from protocols.engine import FinishReason, PauseMode
from protocols.errors import RequestError
from protocols.kv_events import KvMetrics

__all__ = ["RankScheduler"]

_RUNNING = (Phase.PREFILL, Phase.DECODE, Phase.AWAITING_KV)
_COMPUTING = (Phase.PREFILL, Phase.DECODE)


class RankScheduler(LoopMixin):
    """Queues, batch, KV blocks and the step loop of one rank."""

    def __init__(
        self,
        rank: int,
        cfg: MockEngineConfig,
        tokens: TokenModel,
        memory: KvPageMemory,
        events: KvEventPublisher | None,
        publish_metrics: Callable[[KvMetrics], None] | None,
        on_end: Callable[[MockRequest], None],
    ) -> None:
        self.rank, self.cfg, self.tokens = rank, cfg, tokens
        self.memory, self.events = memory, events
        self.pool = BlockPool(cfg.num_blocks, cfg.block_size)
        self.batch = DecodeBatch(cfg.max_running_requests, cfg.block_size, tokens, self.decide)
        self._publish_metrics = publish_metrics
        self._on_end = on_end
        self.waiting: deque[MockRequest] = deque()
        self.running: list[MockRequest] = []  # admission order: PREFILL, DECODE, AWAITING_KV
        self.prefilling: list[MockRequest] = []
        self.owed: dict[str, MockRequest] = {}
        self._needs_block: list[MockRequest] = []
        self._deferred: list[MockRequest] = []
        self._unprepared: list[MockRequest] = []  # awaiting KV, no ExpectedKV yet
        self.received = ReceivedPages(self)
        self._arrived: list[MockRequest] = []  # live migrations decoding here, not stepped yet
        self._gather_until: float | None = None
        self._readers: list[MockRequest] = []
        self._free_slots = list(range(cfg.max_running_requests))  # a heap: lowest first
        self._dirty = False  # running / prefilling hold requests that left them
        self.paused = False
        self.holds = 0  # no step starts while > 0 (a live hand-over at a step boundary)
        self.memory_ready = True
        self.closed = False
        self._urgent = False  # a reader should see this step at once (first or last token)
        self._wake_event: anyio.Event | None = None
        self._step_done: anyio.Event | None = None
        self._clock: float | None = None
        self._metrics_sent: tuple[int, ...] | None = None
        self._metrics_at = 0.0
        self.steps = self.prefill_tokens = self.generated = self.retractions = 0
        self.prompt_tokens = self.cached_tokens = 0
        self.kv_received_tokens = self.handed_over = 0
        self.simulated_s = 0.0
        self.records: list[StepRecord] = []

    # -- calls from the engine and the streams (same thread as the loop) ---------------------

    def wake(self) -> None:
        if self._wake_event is not None:
            self._wake_event.set()

    def submit(self, req: MockRequest) -> None:
        self.waiting.append(req)
        self.wake()

    def load(self) -> tuple[int, int]:
        return len(self.waiting) + len(self.running), self.pool.used

    def sync(self, req: MockRequest) -> None:
        self.batch.sync(req)

    def park(self, req: MockRequest) -> anyio.Event:
        """An event set when ``req`` may have news for its reader."""
        if req.waiter is None:
            req.waiter = anyio.Event()
            self._readers.append(req)
        return req.waiter

    def end(
        self,
        req: MockRequest,
        reason: FinishReason = "cancelled",
        error: RequestError | None = None,
    ) -> None:
        """Finish ``req`` in whatever phase it is (abort, failure, shutdown) and free its KV."""
        if req.phase is not Phase.FINISHED:
            self._end(req, reason, error)
            self.after_change()

    def end_later(self, req: MockRequest) -> None:
        """Abort ``req`` at the next step boundary (from a finaliser, which may run anywhere)."""
        if not self.closed:
            self._deferred.append(req)
            try:
                self.wake()
            except RuntimeError:
                pass  # the event loop is gone: nothing left to wake

    def after_change(self, *, publish: bool = True) -> None:
        """Tidy the queues and publish after a call changed requests or blocks; ``publish=False``
        leaves the KV events to the step loop's next turn, one batch for a burst of calls (a
        drain's live migrations arriving together)."""
        self._compact()
        if publish:
            self.flush_events()
        self.wake()

    def pause(self, mode: PauseMode) -> None:
        self.paused = True
        if mode is PauseMode.ABORT:
            for req in [*self.waiting, *self.running]:
                self._end(req, "cancelled", None)
        elif mode is PauseMode.RETRACT:
            # A request waiting for its KV keeps its blocks: a transfer may be writing them.
            retracted = [r for r in self.running if r.phase in _COMPUTING]
            for req in retracted:
                self._retract(req)
            self.waiting.extendleft(reversed(retracted))
        self.after_change()

    def resume(self) -> None:
        self.paused = False
        self.wake()

    def hold(self) -> None:
        """Start no step until :meth:`release_hold` (one in flight completes)."""
        self.holds += 1

    def release_hold(self) -> None:
        self.holds -= 1
        self.wake()

    def holds_kv(self) -> bool:
        return self.pool.used > 0

    def idle(self) -> bool:
        self._compact()
        return not (self.waiting or self.running or self.owed or self._deferred)

    def flush_events(self) -> None:
        events = self.pool.take_events()
        if events and self.events is not None:
            self.events.publish(events)

    # -- request bookkeeping --------------------------------------------------------------

    def _end(self, req: MockRequest, reason: FinishReason, error: RequestError | None) -> None:
        if req.phase is Phase.WAITING:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.owed.pop(req.rid, None)
        self._free(req)
        req.phase = Phase.FINISHED
        self._dirty = True
        if error is not None and not req.done:
            req.error = error
        elif req.finish_reason is None and req.error is None:
            req.finish_reason = reason
        self._urgent = True
        req.wake()
        if req.transfer_ready is not None:
            req.transfer_ready.set()
        self._on_end(req)

    def _free(self, req: MockRequest) -> None:
        if req.phase is Phase.DECODE:
            self.batch.leave(req)
        if req.slot >= 0:
            heapq.heappush(self._free_slots, req.slot)
            req.slot = -1
        if req.blocks:
            self.pool.release(req.blocks)
            req.blocks = []

    def _retract(self, req: MockRequest) -> None:
        self._free(req)
        req.kv_len = 0
        req.phase = Phase.WAITING
        self._dirty = True
        self.retractions += 1

    def _compact(self) -> None:
        if self._dirty:
            self._dirty = False
            self.running = [r for r in self.running if r.phase in _RUNNING]
            self.prefilling = [r for r in self.prefilling if r.phase is Phase.PREFILL]

    def decide(
        self, req: MockRequest, regular: int, eos: bool, ngen: int, h: int
    ) -> tuple[int, FinishReason | None]:
        """The token ``req`` produces after ``ngen`` tokens given the model's candidates (for a
        sequence of hash ``h``), and whether it stops there."""
        suppress = ngen < req.min_new  # min_tokens: no stop token before that many
        token = self.tokens.eos_token_id if eos and not suppress else regular
        if req.steer is not None:
            return self._steered(req, req.steer, token, suppress, h)
        if token in req.stop:
            if not suppress:
                return token, "stop"
            token = self.tokens.alternative(token, req.stop)
        return token, None

    def _steered(
        self, req: MockRequest, steer: Steering, natural: int, suppress: bool, h: int
    ) -> tuple[int, FinishReason | None]:
        token = steer.choose(h, req.seed_word, natural, req.stop if suppress else frozenset())
        if token < 0:  # nothing left to choose from: the request ends as the model stopped
            return steer.eos_token_id, "stop"
        stops = token in req.stop and not suppress
        steer.accept(token, stops)
        return token, "stop" if stops or steer.terminated else None

    def start_decoding(
        self, req: MockRequest, h: int, token: int, reason: FinishReason | None
    ) -> None:
        """Append the token a prefill (or a KV transfer) produced after a sequence of hash
        ``h``; then decode, or finish."""
        self._append(req, token)
        self._urgent = True
        if reason is not None or req.ngen >= req.max_new:
            self._end(req, reason or "length", None)
            return
        self._dirty = True  # no longer prefilling
        self.batch.add(req, self.tokens.extend(h, token))
        if req.kv_len == len(req.blocks) * self.cfg.block_size:
            self._needs_block.append(req)
        req.wake()

    # -- planning -------------------------------------------------------------------------

    def admit_now(self, req: MockRequest) -> bool:
        """A live migration's request: admit it for its KV transfer at once, ahead of the queue,
        or not at all (no slot or no blocks free now)."""
        self._compact()
        if self.paused or self.closed or not self.memory_ready:
            return False
        if len(self.running) >= self.cfg.max_running_requests or not self._admit(req, True):
            return False
        self.after_change(publish=False)  # its evictions: with the others of a drain's burst
        return True

    def prepare_transfers(self) -> None:
        """Work out the expected KV of the requests now waiting for theirs (the step loop does
        it, at its turn after their admission: the caller has asked for the KV by then, and
        its arrival is left with comparing pages, not hashing a context)."""
        reqs, self._unprepared = self._unprepared, []
        for req in reqs:
            if req.phase is Phase.AWAITING_KV and req.expected is None:
                req.expected = expected_kv(req, self.cfg.block_size, self.tokens)

    def covered_at_boundary(self, req: MockRequest) -> int:
        """The tokens of ``req`` (decoding) whose KV the next step boundary will hold: all but
        the newest, which is the one the step in flight samples if ``req`` is in it."""
        self.batch.sync(req)
        return len(req.seq) - 1 + self.batch.in_step(req)

    def hand_over(self, reqs: Sequence[MockRequest]) -> dict[str, int]:
        """Decode, live migration: ``reqs`` (decoding) stop here; their streams end
        ``cancelled`` and their KV stays owed to the transfer layer (see ``_hold``). The KV
        covers every token but the newest: that one's KV is only computed by the next decode
        step. Called between steps (``hold``), so no step's work is lost. Returns the token
        model's hash of the tokens each one's KV covers (the next engine starts from it)."""
        covered: dict[str, int] = {}
        for req in reqs:
            h = self.batch.hash_of(req)
            self.batch.leave(req)  # synced: ``seq`` ends in the newest token
            covered[req.rid] = self.tokens.retract(h, req.seq[-1])
        write_partials(reqs, self.cfg.block_size, self.memory)
        for req in reqs:
            self.handed_over += 1
            self._hold(req, "cancelled")
        self.after_change()
        return covered

    def _admit(self, req: MockRequest, transfer: bool) -> bool:
        cfg = self.cfg
        if transfer:
            new = self.pool.allocate(cfg.blocks_for(req.prompt_len))
            if new is None:
                return False
            req.blocks = new
            req.phase = Phase.AWAITING_KV
            req.deadline = anyio.current_time() + cfg.transfer_timeout_s
            if not req.request.live_migration:  # (its KV comes with its hash: see _received)
                self._unprepared.append(req)  # the loop's next turn, while the transfer runs
            if req.transfer_ready is not None:
                req.transfer_ready.set()
        else:
            n = len(req.seq)
            matched = self.pool.match(hashes_upto(req, (n - 1) // cfg.block_size, cfg.block_size))
            new = self.pool.allocate(cfg.blocks_for(n) - len(matched))
            if new is None:
                self.pool.release(matched)
                return False
            req.blocks = matched + new
            req.kv_len = len(matched) * cfg.block_size
            req.phase = Phase.PREFILL
            self.prefilling.append(req)
        if not req.was_admitted:
            req.was_admitted = True
            req.cached_tokens = req.kv_len
            self.prompt_tokens += req.prompt_len
            self.cached_tokens += req.kv_len
        req.slot = heapq.heappop(self._free_slots)
        self.running.append(req)
        return True

    def _grow_decoders(self) -> None:
        bs = self.cfg.block_size
        for req in self._needs_block:
            while req.phase is Phase.DECODE and self.batch.kv_of(req) >= len(req.blocks) * bs:
                got = self.pool.allocate(1)
                if got is not None:
                    req.blocks.extend(got)
                    self.batch.grow(req)
                    break
                victim = next(r for r in reversed(self.running) if r.phase in _COMPUTING)
                self._retract(victim)
                self.waiting.appendleft(victim)
                self._compact()
        self._needs_block.clear()

    def _plan(self) -> Step | None:
        cfg = self.cfg
        if self._needs_block:
            self._grow_decoders()
        decode = self.batch.size
        budget = cfg.max_batch_tokens - decode
        chunks: list[tuple[MockRequest, int]] = []
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(len(req.seq) - req.kv_len, budget)
            chunks.append((req, n))
            budget -= n
        disagg = cfg.role == "decode"
        while self.waiting and len(self.running) < cfg.max_running_requests:
            req = self.waiting[0]
            transfer = disagg and req.bootstrap is not None
            if not transfer and budget <= 0:
                break
            if not self._admit(req, transfer):
                break
            self.waiting.popleft()
            if not transfer:
                n = min(len(req.seq) - req.kv_len, budget)
                chunks.append((req, n))
                budget -= n
        if not chunks and not decode:
            return None
        prefill = sum(n for _, n in chunks)
        # The step reads the KV of the requests it computes: pages allocated for a transfer
        # still in flight are not read (16 live migrations landing must not make the first
        # one's solo decode steps cost as much as a batch of 16).
        waiting_kv = sum(len(r.blocks) for r in self.running if r.phase is Phase.AWAITING_KV)
        frac = (self.pool.used - waiting_kv) / cfg.num_blocks
        seconds = step_seconds(cfg, prefill, bool(decode), frac)
        if not chunks and self._gather(decode):
            return None
        return chunks, self.batch.hi if decode else 0, seconds, prefill, decode, frac

    # -- committing -----------------------------------------------------------------------

    def _commit(self, step: Step) -> None:
        chunks, hi, seconds = step[:3]
        self.steps += 1
        self.simulated_s += seconds
        if hi:
            self.stepped()
            produced, (fills, finished, full) = self.batch.commit(hi)
            self.generated += produced
            for req, start, end in fills:
                self.batch.sync(req)
                fill_pages(req, start, end, self.cfg.block_size, self.memory, self.pool)
            for req, why in finished:
                self._end(req, why, None)
            self._needs_block.extend(full)
        self.batch.thaw()
        done: list[MockRequest] = []
        for req, n in chunks:
            if req.phase is not Phase.PREFILL:
                continue  # aborted or retracted while the step ran
            start = req.kv_len
            req.kv_len += n
            self.prefill_tokens += n
            fill_pages(req, start, req.kv_len, self.cfg.block_size, self.memory, self.pool)
            if req.kv_len == len(req.seq):
                done.append(req)
        if done:
            self._complete_prefills(done)
        self._compact()
        self.flush_events()

    def _complete_prefills(self, done: list[MockRequest]) -> None:
        hs = np.array([self.tokens.prefix_hash(r.seq) for r in done], dtype=np.uint64)
        seeds = np.array([r.seed_word for r in done], dtype=np.uint64)
        regular, eos = self.tokens.next_tokens(hs, seeds)
        prefill_role = self.cfg.role == "prefill"
        write_partials(done, self.cfg.block_size, self.memory)
        for i, req in enumerate(done):
            token: int | None = None
            reason: FinishReason | None = None
            if req.ngen < req.max_new:
                flag = bool(eos is not None and eos[i])
                token, reason = self.decide(req, int(regular[i]), flag, req.ngen, int(hs[i]))
            if prefill_role and req.bootstrap is not None:
                self._owe(req, token, reason)
            elif token is None:
                self._end(req, "length", None)
            elif prefill_role:  # prefill-only, nothing owed: one token and done
                self._append(req, token)
                self._end(req, reason or "length", None)
            else:
                self.start_decoding(req, int(hs[i]), token, reason)

    def _append(self, req: MockRequest, token: int) -> None:
        req.seq.append(token)
        req.ngen += 1
        self.generated += 1

    def _owe(self, req: MockRequest, token: int | None, reason: FinishReason | None) -> None:
        """Prefill role: the token (if any) goes out; the KV is owed to decode."""
        if token is not None:
            self._append(req, token)
        req.disagg_params = req.bootstrap
        self._hold(req, reason or "length")

    def _hold(self, req: MockRequest, reason: FinishReason) -> None:
        """End ``req``'s stream but keep its blocks: they stay until the transfer layer took
        them (``release_transfer``), an abort, or ``transfer_timeout_s``."""
        heapq.heappush(self._free_slots, req.slot)
        req.slot = -1
        req.phase = Phase.OWED
        self._dirty = True
        req.finish_reason = reason
        req.deadline = anyio.current_time() + self.cfg.transfer_timeout_s
        self.owed[req.rid] = req
        self._urgent = True
        req.wake()
        if req.transfer_ready is not None:
            req.transfer_ready.set()
        self._on_end(req)
