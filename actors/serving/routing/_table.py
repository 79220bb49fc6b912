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
import msgspec

from actors import ActorError, ActorRef
from actors.serving.frontend import WorkerState
from protocols import control
from protocols.engine import (
    BootstrapInfo,
    Capacity,
    MemoryTag,
    PreprocessedRequest,
    RoutingHints,
)
from protocols.errors import NoWorkerAvailable
from protocols.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from protocols.pages import page_hash, prompt_page_hashes

__all__ = ["Policy", "RankEntry", "Role", "Routed", "RoutingTable", "WorkerEntry"]

Role = Literal["aggregated", "prefill", "decode"]
Policy = Literal["round_robin", "least_loaded", "kv_aware"]


@attrs.frozen
class Routed:
    """Where one attempt of a request went: a worker (and its rank) that
    :meth:`RoutingTable.take` counted (its request stream gives it back with
    :meth:`RoutingTable.done`)."""

    worker_id: str
    engine: ActorRef[Any]
    bootstrap: BootstrapInfo | None = None  # a prefill worker's KV bootstrap endpoint
    prefills_alone: bool = True  # a decode worker that may serve a request without a prefill
    dp_rank: int | None = None  # the data-parallel rank chosen (None: a single-rank engine)

    def placed(self, request: PreprocessedRequest) -> PreprocessedRequest:
        """``request`` pinned to the rank chosen for it (``routing.dp_rank``), so the engine
        runs it where the router counted it and found its prefix."""
        hints = request.routing
        if (None if hints is None else hints.dp_rank) == self.dp_rank:
            return request
        hints = msgspec.structs.replace(hints or RoutingHints(), dp_rank=self.dp_rank)
        return msgspec.structs.replace(request, routing=hints)


@attrs.define(eq=False)
class RankEntry:
    """One data-parallel rank of a worker: a scheduler of its own, so a load and a KV cache of
    its own."""

    rank: int
    active: int = 0  # requests routed here and not finished (the table's own count)
    reported_active: int = 0  # from the engine's load metrics
    waiting: int = 0
    cache_usage: float = 0.0
    blocks: set[int] = attrs.field(factory=set)  # cached pages, by our page hash
    # The engine's hash of each cached page -> ours: engines hash pages their own way (SGLang
    # 0.5.17: SHA-256), so pages are matched by hashes the router computes from their tokens.
    engine_hashes: dict[int, int] = attrs.field(factory=dict)

    def load(self) -> float:
        """Lower is better: in-flight requests, queue, then KV pressure."""
        return max(self.active, self.reported_active) + self.waiting + self.cache_usage

    def overlap(self, hashes: Sequence[int]) -> int:
        """How many of the leading pages ``hashes`` name this rank holds."""
        count = 0
        for h in hashes:
            if h not in self.blocks:
                break
            count += 1
        return count


@attrs.define(eq=False)
class WorkerEntry:
    id: str
    role: Role
    engine: ActorRef[Any]
    capacity: Capacity
    healthy: bool = True
    draining: bool = False
    released: set[MemoryTag] = attrs.field(factory=set)  # memory the lifecycle released
    paused: bool = False  # generation paused by the lifecycle (for a release)
    ranks: list[RankEntry] = attrs.field(init=False)  # one per data-parallel rank

    @ranks.default
    def _ranks(self) -> list[RankEntry]:
        return [RankEntry(rank) for rank in range(max(1, self.capacity.dp_size))]

    @property
    def routable(self) -> bool:
        # A worker whose engine is restarting stays registered for a moment: never route there.
        return self.healthy and not self.draining and self.engine.is_running

    @property
    def active(self) -> int:
        """Requests routed here and not finished, over every rank."""
        return sum(r.active for r in self.ranks)

    @property
    def reported_active(self) -> int:
        return sum(r.reported_active for r in self.ranks)

    @property
    def waiting(self) -> int:
        return sum(r.waiting for r in self.ranks)

    @property
    def cache_usage(self) -> float:
        """The fraction of the worker's KV blocks in use (every rank has as many)."""
        return sum(r.cache_usage for r in self.ranks) / len(self.ranks)

    def load(self) -> float:
        """What a request routed here meets: its least loaded rank's load."""
        return min(r.load() for r in self.ranks)


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

    def add_role(self, worker_id: str, role: Role) -> None:
        """A worker added at run time (a pool scaled up): known before it registers, so it
        registers with its role."""
        self._roles[worker_id] = role
        self._notify()

    def remove_role(self, worker_id: str) -> None:
        """A worker removed at run time (a pool scaled down, or an addition that failed)."""
        self._roles.pop(worker_id, None)
        self.unregister(worker_id)
        self._notify()

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

    def _rank(self, worker_id: str, dp_rank: int) -> RankEntry | None:
        entry = self.workers.get(worker_id)
        if entry is None or not 0 <= dp_rank < len(entry.ranks):
            return None  # gone, or a report of the engine before a restart changed its ranks
        return entry.ranks[dp_rank]

    def load(self, worker_id: str, dp_rank: int, metrics: Any) -> None:
        rank = self._rank(worker_id, dp_rank)
        if rank is not None:
            rank.reported_active = int(metrics.request_active_slots)
            rank.waiting = int(metrics.num_requests_waiting)
            rank.cache_usage = float(metrics.gpu_cache_usage_perc)

    def kv_events(self, worker_id: str, dp_rank: int, batch: Any) -> None:
        rank = self._rank(worker_id, dp_rank)
        if rank is None:
            return
        block_size = self.workers[worker_id].capacity.block_size
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(rank, block_size, event)
            elif isinstance(event, BlockRemoved):
                for engine_hash in event.block_hashes:
                    ours = rank.engine_hashes.pop(engine_hash, None)
                    if ours is not None:
                        rank.blocks.discard(ours)
            elif isinstance(event, AllBlocksCleared):
                rank.blocks.clear()
                rank.engine_hashes.clear()

    @staticmethod
    def _stored(rank: RankEntry, full: int, event: BlockStored) -> None:
        parent: int | None = None
        if event.parent_block_hash is not None:
            parent = rank.engine_hashes.get(event.parent_block_hash)
            if parent is None:
                return  # its prefix was never seen (events lost): these pages cannot be placed
        size = event.block_size
        for i, engine_hash in enumerate(event.block_hashes):
            page = event.token_ids[i * size : (i + 1) * size]
            if len(page) < full:
                break  # a partial page never matches a prompt's full page
            ours = page_hash(parent, page)
            rank.engine_hashes[engine_hash] = ours
            rank.blocks.add(ours)
            parent = ours

    # -- choosing ---------------------------------------------------------------------------

    def candidates(self, role: Role, exclude: Iterable[str] = ()) -> list[WorkerEntry]:
        skip = set(exclude)
        return [
            w for w in self.workers.values() if w.role == role and w.routable and w.id not in skip
        ]

    def pick(
        self, role: Role, policy: Policy, tokens: Sequence[int], exclude: Iterable[str] = ()
    ) -> tuple[WorkerEntry, RankEntry]:
        """The worker of ``role``, and its rank, to send a request with prompt ``tokens`` to:
        each data-parallel rank is a place of its own, as each has its own load and KV cache."""
        places = [(w, r) for w in self.candidates(role, exclude) for r in w.ranks]
        if not places:
            raise NoWorkerAvailable(f"no routable {role} worker")
        if policy == "round_robin" or len(places) == 1:
            return places[next(self._rr) % len(places)]
        if policy == "least_loaded":
            return min(places, key=lambda place: place[1].load())
        return self._kv_aware(places, tokens)

    def take(
        self, role: Role, policy: Policy, tokens: Sequence[int], exclude: Iterable[str] = ()
    ) -> Routed:
        """:meth:`pick`, and count one more request in flight on that rank (until
        :meth:`done`)."""
        entry, rank = self.pick(role, policy, tokens, exclude)
        rank.active += 1
        capacity = entry.capacity
        dp_rank = rank.rank if len(entry.ranks) > 1 else None
        return Routed(entry.id, entry.engine, capacity.bootstrap, capacity.prefills_alone, dp_rank)

    def done(self, worker_id: str, dp_rank: int | None = None) -> None:
        """A request :meth:`take` counted on that worker's rank ``dp_rank`` is over."""
        rank = self._rank(worker_id, dp_rank or 0)
        if rank is not None and rank.active > 0:
            rank.active -= 1

    def _kv_aware(
        self, places: list[tuple[WorkerEntry, RankEntry]], tokens: Sequence[int]
    ) -> tuple[WorkerEntry, RankEntry]:
        # Dynamo's cost: prefill blocks still to compute plus the decode load; ties go to the
        # least loaded rank.
        block_size = places[0][0].capacity.block_size
        hashes = prompt_page_hashes(tokens, block_size, partial=False)

        def cost(place: tuple[WorkerEntry, RankEntry]) -> tuple[float, float]:
            rank = place[1]
            load = rank.load()
            return (len(hashes) - rank.overlap(hashes) + load, load)

        return min(places, key=cost)

    def overlap(self, worker_id: str, tokens: Sequence[int], dp_rank: int | None = None) -> int:
        """Leading full pages of ``tokens`` the worker holds on rank ``dp_rank`` (``None``: on
        its rank that holds the most)."""
        entry = self.workers[worker_id]
        hashes = prompt_page_hashes(tokens, entry.capacity.block_size, partial=False)
        ranks = entry.ranks if dp_rank is None else [entry.ranks[dp_rank]]
        return max(rank.overlap(hashes) for rank in ranks)
