"""The routing view of one model: its workers, their health, load and cached prefixes.

Workers' health checkers register them here and keep their health current; publishers feed
load metrics and KV events. Only workers that are registered, healthy and not draining are
routable, so nothing is ever routed to a worker that is starting, draining, restarting or
unhealthy. The view lives in the root process and is touched only from its event loop.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import anyio
import attrs

from actors import ActorError, ActorRef
from actors.serving.frontend import WorkerState
from protocols import control
from protocols.engine import BootstrapInfo, Capacity, MemoryTag
from protocols.errors import NoWorkerAvailable
from protocols.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from protocols.pages import page_hash, prompt_page_hashes

__all__ = ["Policy", "Role", "Routed", "RoutingTable", "WorkerEntry"]

Role = Literal["aggregated", "prefill", "decode"]
Policy = Literal["round_robin", "least_loaded", "kv_aware"]


@attrs.frozen
class Routed:
    """Where one attempt of a request went: a worker that :meth:`RoutingTable.take` counted (its
    request stream gives it back with :meth:`RoutingTable.done`)."""

    worker_id: str
    engine: ActorRef[Any]
    bootstrap: BootstrapInfo | None = None  # a prefill worker's KV bootstrap endpoint
    prefills_alone: bool = True  # a decode worker that may serve a request without a prefill


@attrs.define(eq=False)
class WorkerEntry:
    id: str
    role: Role
    engine: ActorRef[Any]
    capacity: Capacity
    healthy: bool = True
    draining: bool = False
    active: int = 0  # requests routed here and not finished (the table's own count)
    reported_active: int = 0  # from the engine's load metrics
    waiting: int = 0
    cache_usage: float = 0.0
    blocks: set[int] = attrs.field(factory=set)  # cached pages, by our page hash (all DP ranks)
    # The engine's hash of each cached page -> ours: engines hash pages their own way (SGLang
    # 0.5.17: SHA-256), so pages are matched by hashes the router computes from their tokens.
    engine_hashes: dict[int, int] = attrs.field(factory=dict)
    released: set[MemoryTag] = attrs.field(factory=set)  # memory the lifecycle released
    paused: bool = False  # generation paused by the lifecycle (for a release)

    @property
    def routable(self) -> bool:
        # A worker whose engine is restarting stays registered for a moment: never route there.
        return self.healthy and not self.draining and self.engine.is_running

    def load(self) -> float:
        """Lower is better: in-flight requests, queue, then KV pressure."""
        return max(self.active, self.reported_active) + self.waiting + self.cache_usage


class RoutingTable:
    """Implements the worker side's ``WorkerDirectory`` and ``WorkerSink``."""

    def __init__(self, roles: dict[str, Role]) -> None:
        self._roles = roles  # worker id -> role, known from the configuration
        self.workers: dict[str, WorkerEntry] = {}
        self._rr = itertools.count()
        self._changed: list[anyio.Event] = []

    def routable(self) -> int:
        """How many workers may take requests now."""
        return sum(w.routable for w in self.workers.values())

    def serving(self) -> bool:
        """Whether a request can be served now: every role the configuration has (prefill and
        decode, or aggregated) has a routable worker. A prefill worker alone serves nothing."""
        routable = {w.role for w in self.workers.values() if w.routable}
        return bool(self._roles) and routable >= set(self._roles.values())

    def states(self) -> dict[str, tuple[Role, WorkerState]]:
        """Each configured worker's role and state: ``ready`` (routable), ``restarting`` (not
        registered, or its engine not running), ``draining`` (out of routing on purpose) or
        ``out_of_service`` (failing its canaries)."""
        out: dict[str, tuple[Role, WorkerState]] = {}
        for worker_id, role in self._roles.items():
            entry = self.workers.get(worker_id)
            state: WorkerState
            if entry is None or not entry.engine.is_running:
                state = "restarting"
            elif entry.draining:
                state = "draining"
            elif not entry.healthy:
                state = "out_of_service"
            else:
                state = "ready"
            out[worker_id] = (role, state)
        return out

    async def wait_routable(self, count: int = 1, role: Role | None = None) -> None:
        """Return once at least ``count`` workers (of ``role``, if given) are routable."""
        while (self.routable() if role is None else len(self.candidates(role))) < count:
            event = anyio.Event()
            self._changed.append(event)
            await event.wait()

    def _notify(self) -> None:
        changed, self._changed = self._changed, []
        for event in changed:
            event.set()

    # -- WorkerDirectory ------------------------------------------------------------------

    def register(self, worker_id: str, engine: ActorRef[Any], capacity: Capacity) -> None:
        role = self._roles.get(worker_id, "aggregated")
        self.workers[worker_id] = WorkerEntry(worker_id, role, engine, capacity)
        self._introduce(worker_id)
        self._notify()

    def _introduce(self, worker_id: str) -> None:
        """Pre-warm KV transfer: decode workers meet every worker whose KV they may read (each
        prefill worker, and each other decode worker for live migration) when either registers,
        so no NIXL metadata exchange ever happens on a request's path."""
        from actors.serving.kv import bootstrap_endpoint

        new = self.workers[worker_id]
        sources = [
            w
            for w in self.workers.values()
            if w.role in ("prefill", "decode") and w.capacity.bootstrap
        ]
        decodes = [w for w in self.workers.values() if w.role == "decode"]
        pairs = [(d, p) for d in decodes for p in sources if d is not p and new in (d, p)]
        for decode, source in pairs:
            assert source.capacity.bootstrap is not None
            endpoint = bootstrap_endpoint(source.capacity.bootstrap)
            try:
                decode.engine.tell_nowait(control.ConnectPeer(endpoint))
            except ActorError:
                pass  # that worker is going away: it will meet the peer when it registers again

    def set_healthy(self, worker_id: str, healthy: bool) -> None:
        entry = self.workers.get(worker_id)
        if entry is not None and entry.healthy != healthy:
            entry.healthy = healthy
            self._notify()

    def unregister(self, worker_id: str) -> None:
        if self.workers.pop(worker_id, None) is not None:
            self._notify()

    def set_draining(self, worker_id: str, draining: bool) -> None:
        entry = self.workers.get(worker_id)
        if entry is not None:
            entry.draining = draining
            self._notify()

    # -- WorkerSink -----------------------------------------------------------------------

    def load(self, worker_id: str, dp_rank: int, metrics: Any) -> None:
        entry = self.workers.get(worker_id)
        if entry is not None:
            entry.reported_active = int(metrics.request_active_slots)
            entry.waiting = int(metrics.num_requests_waiting)
            entry.cache_usage = float(metrics.gpu_cache_usage_perc)

    def kv_events(self, worker_id: str, dp_rank: int, batch: Any) -> None:
        entry = self.workers.get(worker_id)
        if entry is None:
            return
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(entry, event)
            elif isinstance(event, BlockRemoved):
                for engine_hash in event.block_hashes:
                    ours = entry.engine_hashes.pop(engine_hash, None)
                    if ours is not None:
                        entry.blocks.discard(ours)
            elif isinstance(event, AllBlocksCleared):
                entry.blocks.clear()
                entry.engine_hashes.clear()

    @staticmethod
    def _stored(entry: WorkerEntry, event: BlockStored) -> None:
        parent: int | None = None
        if event.parent_block_hash is not None:
            parent = entry.engine_hashes.get(event.parent_block_hash)
            if parent is None:
                return  # its prefix was never seen (events lost): these pages cannot be placed
        size = event.block_size
        full = entry.capacity.block_size
        for i, engine_hash in enumerate(event.block_hashes):
            page = event.token_ids[i * size : (i + 1) * size]
            if len(page) < full:
                break  # a partial page never matches a prompt's full page
            ours = page_hash(parent, page)
            entry.engine_hashes[engine_hash] = ours
            entry.blocks.add(ours)
            parent = ours

    # -- choosing ---------------------------------------------------------------------------

    def candidates(self, role: Role, exclude: Iterable[str] = ()) -> list[WorkerEntry]:
        skip = set(exclude)
        return [
            w for w in self.workers.values() if w.role == role and w.routable and w.id not in skip
        ]

    def pick(
        self, role: Role, policy: Policy, tokens: Sequence[int], exclude: Iterable[str] = ()
    ) -> WorkerEntry:
        """The worker of ``role`` to send a request with prompt ``tokens`` to."""
        workers = self.candidates(role, exclude)
        if not workers:
            raise NoWorkerAvailable(f"no routable {role} worker")
        if policy == "round_robin" or len(workers) == 1:
            return workers[next(self._rr) % len(workers)]
        if policy == "least_loaded":
            return min(workers, key=WorkerEntry.load)
        return self._kv_aware(workers, tokens)

    def take(
        self, role: Role, policy: Policy, tokens: Sequence[int], exclude: Iterable[str] = ()
    ) -> WorkerEntry:
        """:meth:`pick`, and count one more request in flight there (until :meth:`done`)."""
        entry = self.pick(role, policy, tokens, exclude)
        entry.active += 1
        return entry

    def done(self, worker_id: str) -> None:
        """A request :meth:`take` counted there is over."""
        worker = self.workers.get(worker_id)
        if worker is not None and worker.active > 0:
            worker.active -= 1

    def _kv_aware(self, workers: list[WorkerEntry], tokens: Sequence[int]) -> WorkerEntry:
        # Dynamo's cost: prefill blocks still to compute plus the decode load; ties go to the
        # least loaded worker.
        block_size = workers[0].capacity.block_size
        hashes = prompt_page_hashes(tokens, block_size, partial=False)

        def cost(worker: WorkerEntry) -> tuple[float, float]:
            overlap = 0
            for h in hashes:
                if h not in worker.blocks:
                    break
                overlap += 1
            return (len(hashes) - overlap + worker.load(), worker.load())

        return min(workers, key=cost)

    def overlap(self, worker_id: str, tokens: Sequence[int]) -> int:
        """Leading full pages of ``tokens`` the worker holds (for tests and introspection)."""
        entry = self.workers[worker_id]
        count = 0
        for h in prompt_page_hashes(tokens, entry.capacity.block_size, partial=False):
            if h not in entry.blocks:
                break
            count += 1
        return count
