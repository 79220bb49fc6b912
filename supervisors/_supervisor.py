"""The supervisor: OTP's semantics on anyio, plus restart backoff.

:class:`Supervisor` answers the calls of :class:`~supervisors._api.SupervisorRef` (start,
terminate, restart, delete, count, find children; statistics); what it does with its children
between calls (start order, exits, strategy, restart scheduling, termination) is
:class:`~supervisors._core.SupervisorCore`'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from actors import ActorRef
from actors.lowlevel import ASK, CellState, Item, Reply
from supervisors import _api as api
from supervisors._children import Child
from supervisors._core import SupervisorCore
from supervisors._errors import (
    ChildAlreadyPresent,
    ChildAlreadyStarted,
    ChildNotFound,
    ChildRestarting,
    ChildRunning,
    ChildStartFailed,
    SupervisorReplyError,
)
from supervisors._spec import ChildSpec, Restart
from supervisors._terminate import terminate

__all__ = ["Supervisor"]


class Supervisor(SupervisorCore):
    """Starts children in order, restarts them per ``flags``, stops them in reverse order.

    With ``Strategy.SIMPLE_ONE_FOR_ONE`` the single spec is a template for dynamic children
    (:meth:`SupervisorRef.start_dynamic`), stopped in parallel.
    """

    async def receive(self, message: Any) -> Any:
        match message:
            case api.StartChild(spec=spec, args=args):
                return await self._start_child(spec, args)
            case api.StartChildAsk(message=first, args=args, reply=reply):
                return await self._start_child_ask(first, args, reply)
            case api.TerminateChild(key=key):
                await self._terminate_child(key)
            case api.RestartChild(child_id=child_id):
                return await self._restart_child(child_id)
            case api.DeleteChild(child_id=child_id):
                self._delete_child(child_id)
            case api.WhichChildren():
                return [c.info() for c in self._children.values()]
            case api.CountChildren():
                return self._count()
            case api.GetChildSpec(key=key):
                return self._find(key).spec
            case api.GetStatistics():
                return self._statistics()
            case _:
                return await super().receive(message)
        return None

    def _find(self, key: api.ChildKey) -> Child:
        # A child's ref is named "<supervisor>/<id>": a lookup by ref is O(1) too (terminating
        # request streams one by one must not be quadratic).
        prefix = f"{self.name}/"
        if isinstance(key, str):
            child_id: str | None = key
        elif isinstance(key, ActorRef) and key.name.startswith(prefix):
            child_id = key.name[len(prefix) :]
        else:
            child_id = None
        child = self._children.get(child_id) if child_id is not None else None
        if child is None or (isinstance(key, ActorRef) and child.ref != key):
            raise ChildNotFound(key)
        return child

    async def _start_child_ask(
        self, message: Any, args: tuple[Any, ...], reply: Reply | None
    ) -> tuple[ActorRef[Any] | None, Reply, ChildStartFailed | None]:
        if not self._dynamic:
            raise SupervisorReplyError("start_dynamic_ask needs a simple_one_for_one supervisor")
        if reply is None:
            reply = self._runtime.backend.reply()
        try:
            ref = await self._start_child(None, args, (ASK, message, reply))
        except ChildStartFailed as exc:
            reply.fail(exc)  # a no-op if the child's end failed it already
            return None, reply, exc
        if ref is None:
            reply.set(None)  # ignored (or already failed by the child's end)
        return ref, reply, None

    async def _start_child(
        self, spec: ChildSpec | None, args: tuple[Any, ...], first: Item | None = None
    ) -> ActorRef[Any] | None:
        if self._dynamic:
            if spec is not None:  # OTP: simple_one_for_one takes start arguments, not specs
                raise SupervisorReplyError("simple_one_for_one starts children with start_dynamic")
            template = self._specs[0]
            child = self._add(template, args, f"{template.id}-{next(self._dynamic_ids)}")
        else:
            if spec is None:
                raise SupervisorReplyError("start_child needs a child spec")
            existing = self._children.get(spec.id)
            if existing is not None:
                if existing.inc is not None:
                    raise ChildAlreadyStarted(spec.id, existing.ref)
                raise ChildAlreadyPresent(spec.id)
            child = self._add(spec)
        try:
            await self._start(child, first)
        except ChildStartFailed:
            self._forget(child)
            raise
        if child.inc is None and (self._dynamic or child.spec.restart is Restart.TEMPORARY):
            self._forget(child)  # OTP keeps no spec for an ignored dynamic or temporary child
            return None
        return child.ref if child.inc is not None else None

    async def _terminate_child(self, key: api.ChildKey) -> None:
        child = self._find(key)
        child.pending_restart = 0
        await terminate(self.name, child)
        if self._dynamic or child.spec.restart is Restart.TEMPORARY:
            self._forget(child)
        else:
            child.ref._cell.set_state(CellState.DEAD)

    async def _restart_child(self, child_id: str) -> ActorRef[Any] | None:
        if self._dynamic:
            raise SupervisorReplyError("restart_child is not supported by simple_one_for_one")
        child = self._find(child_id)
        self._check_idle(child)
        await self._start(child)
        return child.ref if child.inc is not None else None

    def _delete_child(self, child_id: str) -> None:
        if self._dynamic:
            raise SupervisorReplyError("delete_child is not supported by simple_one_for_one")
        child = self._find(child_id)
        self._check_idle(child)
        self._forget(child)

    def _check_idle(self, child: Child) -> None:
        if child.inc is not None:
            raise ChildRunning(child.id)
        if child.ref._cell.state is CellState.RESTARTING:
            raise ChildRestarting(child.id)

    def _count(self) -> api.ChildCount:
        children: Iterable[Child] = self._children.values()
        total = active = supervisors = 0
        for child in children:
            total += 1
            active += child.inc is not None
            supervisors += child.spec.kind == "supervisor"
        # OTP: a simple_one_for_one supervisor has one spec (the template), however many
        # children it runs.
        specs = 1 if self._dynamic else total
        return api.ChildCount(specs, active, supervisors, total - supervisors)

    def _statistics(self) -> api.SupervisorStatistics:
        now = self.clock.now()
        window = sum(1 for t in self._restarts if t >= now - self.flags.period)
        count = self._count()
        return api.SupervisorStatistics(
            name=self.name,
            strategy=self.flags.strategy.value,
            children=len(self._children),
            active=count.active,
            restarts=self._restart_total,
            restarts_in_window=window,
            intensity=self.flags.intensity,
            period=self.flags.period,
        )
