"""The supervisor's OTP core: starting children, exits, strategy, restarts, termination.

A supervisor is an actor. Its children run as tasks in its task group (a dynamic supervisor's
through a :class:`~supervisors._host.TaskHost`), each an :class:`~actors.lowlevel.Incarnation`
bound to a stable ref. A child's exit arrives as a message, so the strategy is applied one event
at a time and the supervisor stays responsive (also while a child keeps failing to restart).
Delayed restarts are timer tasks that post a message back. The calls a supervisor answers are
:class:`~supervisors._supervisor.Supervisor`'s, built on this core.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections import deque
from collections.abc import Sequence
from typing import Any

import anyio
import attrs

from actors import (
    Actor,
    ActorRef,
    Clock,
    ExitReason,
    Ignore,
    NameTaken,
    RealClock,
    current_registry,
)
from actors.lowlevel import OWNER_GONE, TELL, Cell, CellState, Incarnation, Item
from supervisors._children import Child
from supervisors._errors import ChildStartFailed, InvalidChildSpec
from supervisors._events import emit, forget, set_backoff, set_quarantined
from supervisors._host import TaskHost
from supervisors._spec import AutoShutdown, ChildSpec, Restart, Strategy, SupervisorFlags
from supervisors._terminate import release, terminate, terminate_parallel

__all__ = ["SupervisorCore"]


ESCALATION = ExitReason.shutdown("reached_max_restart_intensity")
AUTO_SHUTDOWN = ExitReason.shutdown("auto_shutdown")


@attrs.frozen(eq=False)
class _ChildExited:
    child: Child
    incarnation: Incarnation
    reason: ExitReason


@attrs.frozen(eq=False)
class _RestartDue:
    group: tuple[Child, ...]
    token: int


class SupervisorCore(Actor):
    """The supervisor minus its API: applies OTP's semantics to the children it is given."""

    def __init__(
        self,
        children: Sequence[ChildSpec] = (),
        flags: SupervisorFlags | None = None,
        *,
        name: str = "supervisor",
        clock: Clock | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.flags = flags or SupervisorFlags()
        self.name = name
        self.clock: Clock = clock or RealClock()
        self._rng = rng or random.Random()
        self._dynamic = self.flags.strategy is Strategy.SIMPLE_ONE_FOR_ONE
        specs = list(children)
        seen: set[str] = set()
        for spec in specs:
            if not isinstance(spec, ChildSpec):
                raise InvalidChildSpec(
                    getattr(spec, "id", None), "spec", f"not a ChildSpec: {spec!r}"
                )
            if spec.id in seen:
                raise InvalidChildSpec(spec.id, "id", "duplicate child id")
            seen.add(spec.id)
        if self.flags.strategy is not Strategy.ONE_FOR_ONE and not self._dynamic:
            for spec in specs:
                if spec.quarantine is not None:
                    # Leaving one member of a group down would break the group's strategy.
                    raise InvalidChildSpec(spec.id, "quarantine", "needs a one_for_one supervisor")
        if self._dynamic and len(specs) != 1:
            raise InvalidChildSpec(
                None, "children", "simple_one_for_one needs exactly one template spec"
            )
        self._specs = specs
        self._children: dict[str, Child] = {}
        self._restarts: deque[float] = deque()
        self._restart_total = 0
        self._tokens = itertools.count(1)
        self._dynamic_ids = itertools.count(1)
        self._host: TaskHost | None = None  # a dynamic supervisor's children (one per request)

    # -- lifecycle -------------------------------------------------------------------------

    async def started(self) -> None:
        self.start_soon(self._release_at_exit, name=f"{self.name} guard")
        if self._dynamic:
            self._host = TaskHost(self.task_group)
            self.start_soon(self._host.run, name=f"{self.name} children")
            return
        for spec in self._specs:
            try:
                child = self._add(spec)
                await self._start(child)
            except ChildStartFailed:
                failed = self._children.pop(spec.id, None)
                if failed is not None:
                    # Free its name too, or this supervisor's next incarnation meets NameTaken.
                    release([failed])
                await self._terminate_all()
                raise
            if child.inc is None and spec.restart is Restart.TEMPORARY:
                self._forget(child)  # OTP keeps no spec for an ignored temporary child

    async def stopping(self, reason: ExitReason) -> None:
        await self._terminate_all()

    async def receive(self, message: Any) -> Any:
        match message:
            case _ChildExited(child=child, incarnation=inc, reason=reason):
                await self._child_exited(child, inc, reason)
            case _RestartDue(group=group, token=token):
                # Members terminated or deleted meanwhile are no longer due.
                due = [
                    c for c in group if c.pending_restart == token and self._children.get(c.id) is c
                ]
                if due:
                    await self._restart_group(due)
            case _:
                return await super().receive(message)
        return None

    # -- starting ----------------------------------------------------------------------------

    def _add(
        self, spec: ChildSpec, args: tuple[Any, ...] = (), child_id: str | None = None
    ) -> Child:
        child_id = child_id or spec.id
        cell = Cell(f"{self.name}/{child_id}", spec.while_restarting)
        child = Child(child_id, spec, ActorRef(cell), args)
        if spec.name is not None:
            try:
                current_registry().register(spec.name, child.ref)
            except NameTaken as exc:  # OTP: {error, {already_started, Pid}}
                raise self._start_failed(child, exc) from None
        self._children[child_id] = child
        return child

    async def _start(self, child: Child, first: Item | None = None) -> None:
        """Start one incarnation and wait until it is ready; :class:`ChildStartFailed` if not.

        An ``ignore`` start leaves the child not running and returns normally. ``first`` is put
        in the new incarnation's mailbox before it runs.
        """
        try:
            actor = child.spec.start(*child.args)
        except Exception as exc:
            raise self._start_failed(child, exc) from exc
        inc = Incarnation(actor, child.ref, self._runtime.backend)
        child.inc = inc
        if first is not None:
            inc.mailbox.put_nowait(first)
        on_exit = functools.partial(self._on_exit, child, inc)
        if self._host is not None:
            self._host.start_soon(inc.run, child.ref._cell, on_exit, name=child.ref.name)
        else:
            self.task_group.start_soon(inc.run, child.ref._cell, on_exit, name=child.ref.name)
        try:
            await inc.ready.wait(child.spec.start_timeout)
        except Ignore:
            child.inc = None
            child.ref._cell.set_state(CellState.DEAD)
            emit(self.name, child.label, "ignored")
            return
        except TimeoutError as exc:
            inc.kill(ExitReason.killed("start timeout"))
            await inc.finished.wait()
            child.inc = None
            raise self._start_failed(child, exc) from None
        except Exception as exc:
            child.inc = None
            raise self._start_failed(child, exc) from None
        child.started_at = self.clock.now()
        emit(self.name, child.label, "started", incarnation=child.ref._cell.incarnation)

    def _start_failed(self, child: Child, exc: BaseException) -> ChildStartFailed:
        emit(self.name, child.label, "start_failed", error=f"{type(exc).__name__}: {exc}")
        return ChildStartFailed(child.id, exc)

    # -- exits and restarts ------------------------------------------------------------------

    def _on_exit(self, child: Child, inc: Incarnation, reason: ExitReason) -> CellState:
        """Runs in the exiting child's task: choose the ref's next state, then tell ourselves."""
        if child.inc is not inc or child.terminating or reason is OWNER_GONE or self.stop_requested:
            return CellState.DEAD
        self._runtime.mailbox.put_system((TELL, _ChildExited(child, inc, reason), None))
        return CellState.RESTARTING if child.wants_restart(reason) else CellState.DEAD

    async def _child_exited(self, child: Child, inc: Incarnation, reason: ExitReason) -> None:
        if child.inc is not inc:
            return
        child.inc = None
        emit(self.name, child.label, "exited", reason=str(reason), abnormal=reason.is_abnormal)
        if (
            child.spec.backoff is not None
            and self.clock.now() - child.started_at >= child.spec.backoff.reset_after
        ):
            child.restart_attempts = 0
        if not child.wants_restart(reason):
            if child.spec.restart is Restart.TEMPORARY:
                self._forget(child)
            self._check_auto_shutdown(child)
            return
        if not self._may_restart(child):
            return
        await self._apply_strategy(child)

    def _may_restart(self, child: Child, *, ran: bool = True) -> bool:
        """Count a restart of ``child`` (which ``ran``, or failed to start): ``False`` if it must
        not happen now (the supervisor escalated, or the child was quarantined and will be
        started after its cooldown)."""
        policy = child.spec.quarantine
        if policy is None:
            return self._record_restart()
        now = self.clock.now()
        window = child.recent_restarts
        if child.quarantines and ran and now - child.started_at >= policy.period:
            child.quarantines = 0  # back from quarantine and up for a whole period: healed
            window.clear()
        if not child.quarantines:
            while window and window[0] < now - policy.period:
                window.popleft()
            window.append(now)
            if len(window) <= policy.intensity:
                return True
        # Over the intensity, or failing again while on probation after a quarantine.
        child.quarantines += 1
        delay = policy.delay(child.quarantines)
        child.quarantined = True
        child.ref._cell.set_state(CellState.RESTARTING)
        token = child.pending_restart = next(self._tokens)
        set_quarantined(self.name, child.label, True)
        set_backoff(self.name, child.label, delay)
        emit(
            self.name,
            child.label,
            "quarantined",
            restarts=len(window),
            period=policy.period,
            cooldown=round(delay, 4),
            quarantines=child.quarantines,
        )
        self.start_soon(self._restart_after, delay, (child,), token)
        return False

    def _record_restart(self) -> bool:
        """Count a restart; over the intensity, give up and escalate (``False``)."""
        now = self.clock.now()
        window = self._restarts
        window.append(now)
        # OTP keeps the restarts at most ``period`` old (supervisor:add_restart, inclusive).
        while window and window[0] < now - self.flags.period:
            window.popleft()
        self._restart_total += 1
        if len(window) > self.flags.intensity:
            emit(self.name, "-", "escalated", restarts=len(window), period=self.flags.period)
            self.stop(ESCALATION)
            return False
        return True

    async def _apply_strategy(self, failed: Child) -> None:
        strategy = self.flags.strategy
        if strategy in (Strategy.ONE_FOR_ONE, Strategy.SIMPLE_ONE_FOR_ONE):
            group = [failed]
        else:
            order = list(self._children.values())
            group = order if strategy is Strategy.ONE_FOR_ALL else order[order.index(failed) :]
            for sibling in reversed(group):
                if sibling is not failed:
                    await terminate(self.name, sibling)
            for sibling in group:
                if sibling.spec.restart is Restart.TEMPORARY and sibling is not failed:
                    # OTP: a temporary bystander is never restarted, and forgotten.
                    self._forget(sibling)
            group = [c for c in group if self._children.get(c.id) is c]
        await self._schedule_restart(failed, group)

    async def _schedule_restart(
        self, failed: Child, group: list[Child], *, retry: bool = False
    ) -> None:
        for child in group:
            child.ref._cell.set_state(CellState.RESTARTING)
        backoff = failed.spec.backoff
        delay = backoff.delay(failed.restart_attempts, self._rng.random()) if backoff else 0.0
        failed.restart_attempts += 1
        if delay <= 0 and not retry:
            await self._restart_group(group)
            return
        token = next(self._tokens)
        for child in group:
            child.pending_restart = token
        if delay <= 0:
            # OTP's try_again_restart: a retry after a failed restart is a message of its own,
            # so the supervisor answers calls (and can be stopped) between attempts.
            self._runtime.mailbox.put_system((TELL, _RestartDue(tuple(group), token), None))
            return
        set_backoff(self.name, failed.label, delay)
        emit(
            self.name,
            failed.label,
            "backoff",
            delay=round(delay, 4),
            attempt=failed.restart_attempts,
        )
        self.start_soon(self._restart_after, delay, tuple(group), token)

    async def _restart_after(self, delay: float, group: tuple[Child, ...], token: int) -> None:
        await self.clock.sleep(delay)
        self._runtime.mailbox.put_system((TELL, _RestartDue(group, token), None))

    async def _restart_group(self, group: list[Child]) -> None:
        started: list[Child] = []
        for child in group:
            child.pending_restart = 0
            set_backoff(self.name, child.label, 0.0)
            if child.quarantined:
                child.quarantined = False
                set_quarantined(self.name, child.label, False)
            try:
                await self._start(child)
            except ChildStartFailed:
                # OTP: a failed restart counts as another restart; the siblings already
                # restarted in this round are terminated again and the group retried.
                for done in reversed(started):
                    await terminate(self.name, done)
                for member in group:
                    member.ref._cell.set_state(CellState.RESTARTING)
                if self._may_restart(child, ran=False):
                    await self._schedule_restart(child, group, retry=True)
                return
            started.append(child)
            if child.inc is not None:
                emit(self.name, child.label, "restarted", incarnation=child.ref._cell.incarnation)

    def _check_auto_shutdown(self, child: Child) -> None:
        mode = self.flags.auto_shutdown
        if not child.spec.significant or mode is AutoShutdown.NEVER:
            return
        if mode is AutoShutdown.ALL_SIGNIFICANT and any(
            c.spec.significant and c.inc is not None for c in self._children.values()
        ):
            return
        emit(self.name, child.label, "auto_shutdown")
        self.stop(AUTO_SHUTDOWN)

    # -- stopping ----------------------------------------------------------------------------

    async def _terminate_all(self) -> None:
        children = list(self._children.values())
        if self._dynamic:
            await terminate_parallel(self.name, children, self._specs[0].shutdown_timeout)
        else:
            for child in reversed(children):
                await terminate(self.name, child)
        release(children)

    async def _release_at_exit(self) -> None:
        """Runs as long as the supervisor: however it ends, a kill included (no hook runs then),
        its children's names are freed for its next incarnation."""
        try:
            await anyio.sleep_forever()
        finally:
            release(list(self._children.values()))

    def _forget(self, child: Child) -> None:
        self._children.pop(child.id, None)
        release([child])
        if not self._dynamic:  # dynamic children share their template's series
            forget(self.name, child.label)
