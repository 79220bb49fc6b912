"""Ordered lifecycles for the serving tree: worker drain, memory release/resume, pool scaling
(see ``_scale``), root shutdown.

One :class:`Lifecycle` actor per root orchestrates, through the engine actors and the routing
view; each operation is serialised by its mailbox.

Memory release is a state machine per worker: serving -> unregistered -> paused ->
released{tags} -> resumed -> serving. In-flight requests are handed over (their engine requests
aborted with a *migratable* ``WorkerDraining``, so request streams re-dispatch them), never cut as
``cancelled``. Release and resume are idempotent; a partial resume keeps the worker out of routing
until every released tag is back; a failure rolls back to a routable state. The rolling mode over
a pool cycles one worker at a time, so at least N-1 keep serving.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import attrs

from actors import Actor, ActorError
from actors.serving.errors import LifecycleError
from actors.serving.root._scale import ScaleDown, Scaler, ScaleTo, ScaleUp
from actors.serving.root._stages import Stage, wait_quiescent
from protocols import control
from protocols.engine import DEFAULT_RELEASE_TAGS, MemoryTag, PauseMode
from protocols.errors import RequestError

if TYPE_CHECKING:
    from actors.serving.root._tree import Serving
    from actors.serving.routing import WorkerEntry

__all__ = [
    "Budgets",
    "DrainWorker",
    "Lifecycle",
    "LifecycleError",
    "Release",
    "Resume",
    "UndrainWorker",
    "WorkerStates",
]


@attrs.frozen
class Budgets:
    """Seconds each stage may take. The defaults add up, with the hard deadline's margin, to
    25 s: a SIGTERM'd root is gone within Kubernetes' default 30 s termination grace."""

    grace: float = 2.0  # after unregistering: stale routes may still arrive
    drain: float = 10.0  # in-flight requests finish or are handed over
    transfers: float = 3.0  # a prefill's owed KV transfers
    cleanup: float = 5.0  # engines clean up, the tree stops
    release_grace: float = 0.0  # unregister -> pause for a memory release


@attrs.frozen
class DrainWorker:
    worker: str
    handover: bool = True
    live: bool = True  # a decode worker hands its KV over (live migration) where it can


@attrs.frozen
class UndrainWorker:
    worker: str


@attrs.frozen
class Release:
    worker: str | None = None
    pool: str | None = None
    tags: tuple[MemoryTag, ...] = ()
    rolling: bool = False


@attrs.frozen
class Resume:
    worker: str | None = None
    pool: str | None = None
    tags: tuple[MemoryTag, ...] = ()


@attrs.frozen
class WorkerStates:
    pass


class Lifecycle(Actor):
    """Drains workers, releases and resumes their memory, scales pools, and runs the root's
    shutdown."""

    reply_errors = (LifecycleError,)

    def __init__(self, serving: Serving, budgets: Budgets | None = None) -> None:
        self.serving = serving
        self.budgets = budgets or Budgets()
        self.scaler = Scaler(serving, self.budgets.transfers, self._drain_to_remove)

    async def started(self) -> None:
        self.scaler.publish()

    async def receive(self, message: Any) -> Any:
        match message:
            case DrainWorker(worker=worker, handover=handover, live=live):
                try:
                    await self.drain(worker, handover=handover, live=live)
                except (ActorError, RequestError, TimeoutError) as exc:
                    # The worker failed (died, crashed) under its drain: its supervisor restarts
                    # it; the drain's caller gets the error, this actor goes on.
                    raise LifecycleError(f"drain of {worker!r} failed: {exc}") from None
            case UndrainWorker(worker=worker):
                try:
                    await self.undrain(worker)
                except (ActorError, RequestError, TimeoutError) as exc:
                    raise LifecycleError(f"undrain of {worker!r} failed: {exc}") from None
            case Release(worker=worker, pool=pool, tags=tags, rolling=rolling):
                await self.release(self._targets(worker, pool), tags, rolling=rolling)
            case Resume(worker=worker, pool=pool, tags=tags):
                for target in self._targets(worker, pool):
                    await self.resume(target, tags)
            case WorkerStates():
                return self.states()
            case ScaleUp() | ScaleDown() | ScaleTo():
                return await self.scaler.handle(message)
            case _:
                return await super().receive(message)
        return None

    # -- views ---------------------------------------------------------------------------------

    def _entry(self, worker: str) -> WorkerEntry:
        entry = None
        if worker in self.serving.roles:
            entry = self.serving.table_of(worker).workers.get(worker)
        if entry is None:
            known = ", ".join(sorted(self.serving.roles)) or "none"
            raise LifecycleError(f"unknown or not running worker {worker!r} (workers: {known})")
        return entry

    def _targets(self, worker: str | None, pool: str | None) -> list[str]:
        if (worker is None) == (pool is None):
            raise LifecycleError("name exactly one of a worker or a pool")
        if worker is not None:
            self._entry(worker)
            return [worker]
        roles = {
            "prefill": ("prefill",),
            "decode": ("decode", "aggregated"),
            "aggregated": ("aggregated",),
        }
        if pool not in roles:
            raise LifecycleError(f"unknown pool {pool!r} (prefill, decode)")
        return sorted(w for w, role in self.serving.roles.items() if role in roles[pool])

    def states(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for worker_id in sorted(self.serving.roles):
            entry = self.serving.table_of(worker_id).workers.get(worker_id)
            if entry is None:
                out[worker_id] = {"state": "not_running"}
                continue
            state = "serving"
            if entry.released:
                state = "released"
            elif entry.paused:
                state = "paused"
            elif entry.draining:
                state = "unregistered"
            elif not entry.healthy:
                state = "unhealthy"
            out[worker_id] = {
                "state": state,
                "role": entry.role,
                "released": sorted(t.value for t in entry.released),
                "routable": entry.routable,
            }
        return out

    # -- drain -----------------------------------------------------------------------------

    async def drain(
        self, worker: str, *, handover: bool = True, live: bool = True, operation: str = "drain"
    ) -> None:
        """Unregister, wait the grace period, stop admission and hand over (or drain) in-flight:
        with ``live``, a decode worker's requests move with their KV where they can."""
        entry = self._entry(worker)
        budgets = self.budgets
        with Stage(operation, "unregister", worker=worker):
            self.serving.table_of(worker).set_draining(worker, True)
        grace = budgets.release_grace if operation == "release" else budgets.grace
        with Stage(operation, "grace", worker=worker):
            await anyio.sleep(grace)
        with Stage(operation, "stop_admission", worker=worker, handover=handover):
            await entry.engine.ask(control.Drain(handover=handover, live=live))
        with Stage(operation, "drain", worker=worker):
            with anyio.move_on_after(budgets.drain) as scope:
                await wait_quiescent(entry.engine)
            if scope.cancelled_caught:
                # Out of budget: hand over what is left rather than wait longer.
                await entry.engine.ask(control.Drain(handover=True, live=live))

    async def _drain_to_remove(self, worker: str) -> None:
        await self.drain(worker, handover=True, live=True, operation="scale_down")

    async def undrain(self, worker: str) -> None:
        entry = self._entry(worker)
        if entry.released or entry.paused:
            raise LifecycleError(f"worker {worker!r} has released memory: resume it instead")
        await entry.engine.ask(control.Undrain())
        self.serving.table_of(worker).set_draining(worker, False)

    # -- memory ----------------------------------------------------------------------------

    async def release(
        self, workers: Sequence[str], tags: Iterable[MemoryTag], *, rolling: bool = False
    ) -> None:
        wanted = frozenset(tags) or DEFAULT_RELEASE_TAGS
        for worker in workers:
            await self._release_one(worker, wanted)
            if rolling:
                # Rolling: the worker is back before the next one goes, so N-1 keep serving.
                await self.resume(worker, ())

    async def _release_one(self, worker: str, tags: frozenset[MemoryTag]) -> None:
        entry = self._entry(worker)
        new = set(tags) - entry.released
        if not new:
            return  # already released: an ok no-op
        try:
            if not entry.paused:
                await self.drain(worker, handover=True, operation="release")
                with Stage("release", "pause", worker=worker):
                    await entry.engine.ask(control.Pause(PauseMode.RETRACT))
                    entry.paused = True
            with Stage(
                "release", "release_memory", worker=worker, tags=sorted(t.value for t in new)
            ):
                await entry.engine.ask(
                    control.ReleaseMemory(tuple(sorted(new, key=lambda t: t.value)))
                )
                entry.released |= new
        except (ActorError, RequestError, TimeoutError) as exc:
            await self._roll_back(entry)
            raise LifecycleError(
                f"release of {worker!r} failed and was rolled back: {exc}"
            ) from None

    async def resume(self, worker: str, tags: Iterable[MemoryTag]) -> None:
        entry = self._entry(worker)
        wanted = set(tags) or set(entry.released)
        to_resume = wanted & entry.released
        try:
            if to_resume:
                with Stage(
                    "resume",
                    "resume_memory",
                    worker=worker,
                    tags=sorted(t.value for t in to_resume),
                ):
                    await entry.engine.ask(
                        control.ResumeMemory(tuple(sorted(to_resume, key=lambda t: t.value)))
                    )
                    entry.released -= to_resume
            if entry.released or not entry.paused:
                return  # partial resume: stays out of routing; or nothing was paused: no-op
            await self._serve_again(entry)
        except (ActorError, RequestError, TimeoutError) as exc:
            raise LifecycleError(f"resume of {worker!r} failed: {exc}") from None

    async def _serve_again(self, entry: WorkerEntry) -> None:
        with Stage("resume", "continue", worker=entry.id):
            await entry.engine.ask(control.Undrain(continue_generation=True))
            entry.paused = False
        with Stage("resume", "register", worker=entry.id):
            self.serving.table_of(entry.id).set_draining(entry.id, False)

    async def _roll_back(self, entry: WorkerEntry) -> None:
        """Back to a routable state after a failed release: resume what was released, continue,
        re-register."""
        with Stage("release", "rollback", worker=entry.id):
            if entry.released:
                await entry.engine.ask(control.ResumeMemory(tuple(entry.released)))
                entry.released.clear()
            await self._serve_again(entry)
