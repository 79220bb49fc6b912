"""Pools that change size at run time, as supervision: a worker is added as a child its pool's
supervisor starts at run time, and removed by a drain, then stopped and deleted by that
supervisor.

Scale-up, one worker at a time: the pool's next free id (``decode-2``) -> the routing table learns
its role -> the pool's supervisor starts it (its engine started and warmed up, then its health
checker registers it) -> routable. A worker that fails on the way is no part of the pool: its
child is gone, the table forgets it, and the scale reports the failure. Scale-down: never below
the pool's minimum -> drain with hand-over (live KV migration) -> the KV transfers it still owes
-> the supervisor stops the child and deletes it -> the table forgets the worker. Each change is a
log event, a metric, and a node that appears in or leaves the live tree.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal

import anyio
import attrs
import structlog
from prometheus_client import Counter, Gauge

from actors import ActorError
from actors.serving.errors import LifecycleError, ScaleRefused
from actors.serving.root._stages import Stage, wait_quiescent
from actors.telemetry import REGISTRY
from protocols.errors import RequestError
from supervisors import ChildNotFound, SupervisorError, SupervisorRef

if TYPE_CHECKING:
    from actors.serving.root._tree import ModelServing, Pool, Serving

__all__ = ["ScaleDown", "ScaleRefused", "ScaleTo", "ScaleUp", "Scaler"]

_log = structlog.get_logger("actorserve.scale")
POOL_WORKERS = Gauge(
    "actorserve_pool_workers",
    "Workers of each pool, running or not (what a scale changes).",
    ["model", "pool"],
    registry=REGISTRY,
)
SCALES = Counter(
    "actorserve_pool_scale",
    "Workers added to (up) or removed from (down) a pool, by outcome.",
    ["model", "pool", "direction", "outcome"],
    registry=REGISTRY,
)
Direction = Literal["up", "down"]
Outcome = Literal["ok", "failed", "refused"]
_OUTCOMES: tuple[Outcome, ...] = ("ok", "failed", "refused")


@attrs.frozen
class ScaleUp:
    """Add ``n`` workers to ``pool`` (``prefill`` or ``decode``) of ``model`` (``None``: the
    first served)."""

    pool: str
    n: int = 1
    model: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.n < 1:
            raise ValueError("a scale-up adds at least one worker")


@attrs.frozen
class ScaleDown:
    """Remove ``worker`` from ``pool``, else its ``n`` newest workers (highest ids)."""

    pool: str
    worker: str | None = None
    n: int = 1
    model: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.n < 1:
            raise ValueError("a scale-down removes at least one worker")
        if self.worker is not None and self.n != 1:
            raise ValueError("a named worker is one worker: remove it with n = 1")


@attrs.frozen
class ScaleTo:
    """Add or remove workers until ``pool`` has ``size``."""

    pool: str
    size: int
    model: str | None = None


def _index(worker_id: str) -> int:
    """The number of ``decode-<i>``: the newest worker has the highest."""
    found = re.search(r"-(\d+)$", worker_id)
    return int(found[1]) if found else -1


class Scaler:
    """Runs the scale operations the lifecycle actor receives; ``drain`` is the lifecycle's
    drain of one worker with hand-over (live where it can)."""

    def __init__(
        self, serving: Serving, transfers: float, drain: Callable[[str], Awaitable[None]]
    ) -> None:
        self.serving = serving
        self.transfers = transfers
        self.drain = drain

    def publish(self) -> None:
        """Every pool's size, and its scale counters at 0 (so ``increase()`` sees the first)."""
        for model in self.serving.models:
            for pool in _pools(model):
                POOL_WORKERS.labels(model.name, pool).set(len(model.pool_workers(pool)))
                for direction in ("up", "down"):
                    for outcome in _OUTCOMES:
                        SCALES.labels(model.name, pool, direction, outcome)

    async def handle(self, message: ScaleUp | ScaleDown | ScaleTo) -> dict[str, Any]:
        """Run ``message``; what the pool is now and what changed."""
        model, pool = self._pool(message.model, message.pool)
        added: list[str] = []
        removed: list[str] = []
        match message:
            case ScaleUp(n=n):
                await self._up(model, pool, n, added)
            case ScaleDown(worker=worker, n=n):
                self._check_bounds(model, pool, -n)
                await self._down(model, pool, [None] * n if worker is None else [worker], removed)
            case ScaleTo(size=size):
                now = len(model.pool_workers(pool))
                if size > now:
                    await self._up(model, pool, size - now, added)
                elif size < now:
                    self._check_bounds(model, pool, size - now)
                    await self._down(model, pool, [None] * (now - size), removed)
        return {
            "model": model.name,
            "pool": pool,
            "workers": model.pool_workers(pool),
            "added": added,
            "removed": removed,
        }

    def _pool(self, model_name: str | None, pool: str) -> tuple[ModelServing, Pool]:
        try:
            model = self.serving.model(model_name)
            model.pool_role(pool)
        except LookupError as exc:
            raise ScaleRefused(str(exc)) from None
        return model, "prefill" if pool == "prefill" else "decode"

    def _check_bounds(self, model: ModelServing, pool: Pool, change: int) -> None:
        """Refuse adding (``change`` > 0) or removing workers past ``pool``'s bounds, before
        anything changes."""
        workers = len(model.pool_workers(pool))
        minimum, maximum = model.bounds(pool)
        if change < 0 and workers + change < minimum:
            direction: Direction = "down"
            side, bound, word = "min", minimum, "below"
        elif change > 0 and maximum is not None and workers + change > maximum:
            direction, side, bound, word = "up", "max", maximum, "above"
        else:
            return
        self._record(model, pool, direction, "refused", workers=workers, **{f"{side}imum": bound})
        raise ScaleRefused(
            f"the {pool} pool of {model.name!r} has {workers} "
            f"worker{'' if workers == 1 else 's'} and may not go {word} {bound} "
            f"(--{side}-{pool}-workers)"
        )

    def _record(
        self, model: ModelServing, pool: Pool, direction: Direction, outcome: Outcome, **fields: Any
    ) -> None:
        """The change's metrics and its log event."""
        SCALES.labels(model.name, pool, direction, outcome).inc()
        size = len(model.pool_workers(pool))
        POOL_WORKERS.labels(model.name, pool).set(size)
        log = _log.warning if outcome == "failed" else _log.info
        log(
            "scale",
            model=model.name,
            pool=pool,
            direction=direction,
            outcome=outcome,
            pool_workers=size,
            **fields,
        )

    async def _supervisor(self, model: ModelServing, pool: Pool) -> SupervisorRef:
        try:
            return await self.serving.pool_supervisor(model, pool)
        except (LookupError, ActorError, SupervisorError) as exc:
            problem = f"the {pool} pool of {model.name!r} is not running: {exc}"
            raise LifecycleError(problem) from None

    # -- up ------------------------------------------------------------------------------------

    async def _up(self, model: ModelServing, pool: Pool, n: int, added: list[str]) -> None:
        self._check_bounds(model, pool, n)
        for _ in range(n):
            try:
                added.append(await self._add(model, pool))
            except LifecycleError as exc:
                raise _after(exc, "added", added) from None

    async def _add(self, model: ModelServing, pool: Pool) -> str:
        worker = model.next_worker_id(pool)
        fields = {"model": model.name, "pool": pool, "worker": worker}
        supervisor = await self._supervisor(model, pool)
        table = model.table
        table.add_role(worker, model.pool_role(pool))
        started = False
        try:
            with Stage("scale_up", "start", **fields):
                started = await supervisor.start_child(self.serving.worker_spec(worker)) is not None
            with Stage("scale_up", "register", **fields):
                # Its health checker registered it as it started, as the initial workers are.
                entry = table.workers.get(worker)
                if entry is None or not entry.routable:
                    raise LifecycleError(f"{worker!r} started but is not routable")
        except (LifecycleError, ActorError, SupervisorError) as exc:
            if started:
                await _stop(supervisor, worker)
            table.remove_role(worker)
            self._record(model, pool, "up", "failed", worker=worker, error=str(exc))
            size = len(model.pool_workers(pool))
            raise LifecycleError(
                f"adding {worker!r} to the {pool} pool failed ({exc}); it keeps {size} workers"
            ) from None
        self._record(model, pool, "up", "ok", worker=worker)
        return worker

    # -- down ----------------------------------------------------------------------------------

    async def _down(
        self, model: ModelServing, pool: Pool, workers: list[str | None], removed: list[str]
    ) -> None:
        for worker in workers:
            try:
                removed.append(await self._remove(model, pool, worker))
            except LifecycleError as exc:
                raise _after(exc, "removed", removed) from None

    async def _remove(self, model: ModelServing, pool: Pool, worker: str | None) -> str:
        workers = model.pool_workers(pool)
        if worker is None:
            worker = max(workers, key=_index)
        elif worker not in workers:
            self._record(model, pool, "down", "refused", worker=worker)
            raise ScaleRefused(
                f"{worker!r} is no worker of the {pool} pool of {model.name!r} "
                f"(workers: {', '.join(workers)})"
            )
        self._check_bounds(model, pool, -1)
        fields = {"model": model.name, "pool": pool, "worker": worker}
        supervisor = await self._supervisor(model, pool)
        entry = model.table.workers.get(worker)
        if entry is not None:  # running: its requests move first (none is cut)
            try:
                await self.drain(worker)
                with Stage("scale_down", "transfers", **fields):
                    with anyio.move_on_after(self.transfers):
                        await wait_quiescent(entry.engine)
            except (LifecycleError, ActorError, RequestError, TimeoutError) as exc:
                # It failed under the drain: its requests migrate as off any failed worker.
                _log.warning("scale: the worker failed while draining", error=str(exc), **fields)
        try:
            with Stage("scale_down", "stop", **fields):
                await _stop(supervisor, worker)
        except (ActorError, SupervisorError) as exc:
            self._record(model, pool, "down", "failed", worker=worker, error=str(exc))
            raise LifecycleError(f"stopping {worker!r} failed: {exc}") from None
        model.table.remove_role(worker)
        self._record(model, pool, "down", "ok", worker=worker)
        return worker


def _after(exc: LifecycleError, done: str, workers: list[str]) -> LifecycleError:
    """``exc``, saying which workers the operation had changed before it failed."""
    if not workers:
        return exc
    return type(exc)(f"{exc} ({done} before it: {', '.join(workers)})")


def _pools(model: ModelServing) -> list[Pool]:
    return ["prefill", "decode"] if model.config.mode == "disaggregated" else ["decode"]


async def _stop(supervisor: SupervisorRef, worker: str) -> None:
    """Stop the child ``worker`` and delete its spec (gone already: nothing to do)."""
    try:
        await supervisor.terminate_child(worker)
        await supervisor.delete_child(worker)
    except ChildNotFound:
        pass
