"""The child administration API: messages a supervisor answers, and :class:`SupervisorRef`."""

from __future__ import annotations

from typing import Any, Literal, TypeVar, overload

import attrs

from actors import ActorError, ActorRef, Call
from actors.lowlevel import Reply, backend
from supervisors._errors import ChildStartFailed
from supervisors._spec import ChildSpec

__all__ = [
    "ChildCount",
    "ChildInfo",
    "CountChildren",
    "DeleteChild",
    "GetChildSpec",
    "RestartChild",
    "StartChild",
    "StartChildAsk",
    "SupervisorRef",
    "SupervisorStatistics",
    "TerminateChild",
    "WhichChildren",
]

ChildKey = str | ActorRef[Any]
T = TypeVar("T")


@attrs.frozen
class ChildInfo:
    """One row of ``which_children``. Refs are stable across restarts, so ``ref`` is always the
    child's ref; ``state`` says whether an incarnation runs (OTP shows a pid, ``restarting`` or
    ``undefined``)."""

    id: str
    ref: ActorRef[Any]
    state: Literal["running", "restarting", "quarantined", "undefined"]
    kind: Literal["worker", "supervisor"]


@attrs.frozen
class ChildCount:
    """OTP's ``count_children``: ``specs`` (1 for simple_one_for_one: the template), ``active``
    (running), ``supervisors`` and ``workers`` (children by kind, running or not)."""

    specs: int
    active: int
    supervisors: int
    workers: int


@attrs.frozen
class SupervisorStatistics:
    name: str
    strategy: str
    children: int
    active: int
    restarts: int
    restarts_in_window: int
    intensity: int
    period: float


@attrs.frozen
class StartChild(Call["ActorRef[Any] | None"]):
    spec: ChildSpec | None = None
    args: tuple[Any, ...] = ()


@attrs.frozen
class StartChildAsk(Call[tuple[ActorRef[Any] | None, Reply, ChildStartFailed | None]]):
    """``simple_one_for_one``: start a child with ``message`` already in its mailbox, as an ask
    whose reply comes in the returned :class:`~actors.lowlevel.Reply`; with the start's failure,
    if it failed (the reply is then done too, so the caller always reads it)."""

    message: Any
    args: tuple[Any, ...] = ()
    reply: Reply | None = None  # the caller's, else a new one


@attrs.frozen
class TerminateChild(Call[None]):
    key: ChildKey


@attrs.frozen
class RestartChild(Call["ActorRef[Any] | None"]):
    child_id: str


@attrs.frozen
class DeleteChild(Call[None]):
    child_id: str


@attrs.frozen
class WhichChildren(Call[list[ChildInfo]]):
    pass


@attrs.frozen
class CountChildren(Call[ChildCount]):
    pass


@attrs.frozen
class GetChildSpec(Call[ChildSpec]):
    key: ChildKey


@attrs.frozen
class GetStatistics(Call[SupervisorStatistics]):
    pass


class SupervisorRef:
    """Typed calls on a supervisor's ref (OTP's ``supervisor:*`` functions).

    Errors come back as :class:`~supervisors.SupervisorError` subclasses. Calls wait without a
    timeout by default, as OTP's do: starting a GPU engine can take minutes.
    """

    __slots__ = ("ref",)

    def __init__(self, ref: ActorRef[Any]) -> None:
        self.ref = ref

    def __repr__(self) -> str:
        return f"<SupervisorRef {self.ref.name}>"

    async def start_child(
        self, spec: ChildSpec, *, timeout: float | None = None
    ) -> ActorRef[Any] | None:
        """Add and start a child (``None`` if it started as ``ignore``)."""
        return await self.ref.ask(StartChild(spec=spec), timeout=timeout)

    async def start_dynamic(self, *args: Any, timeout: float | None = None) -> ActorRef[Any] | None:
        """``simple_one_for_one``: start a child from the template with ``args``."""
        return await self.ref.ask(StartChild(args=args), timeout=timeout)

    @overload
    async def start_dynamic_ask(
        self, message: Call[T], *args: Any, timeout: float | None = ...
    ) -> tuple[ActorRef[Any], T] | None: ...

    @overload
    async def start_dynamic_ask(
        self, message: object, *args: Any, timeout: float | None = ...
    ) -> tuple[ActorRef[Any], Any] | None: ...

    async def start_dynamic_ask(
        self, message: Any, *args: Any, timeout: float | None = None
    ) -> tuple[ActorRef[Any], Any] | None:
        """``simple_one_for_one``: start a child from the template with ``args`` and ask it
        ``message``; its ref and reply (``None`` if it started as ``ignore``).

        The message is in the child's mailbox before it starts, so the child handles it as soon
        as it runs: the reply comes one round trip sooner than ``start_dynamic`` then ``ask``.
        Raises :class:`~supervisors.ChildStartFailed` if the start failed, else what ``ask``
        raises. Cancelled before it returns, the child may still be started and handle
        ``message``: a caller that must then end it learns its ref some other way (through the
        message, say).
        """
        # The supervisor's own event loop backend (bound with it): none to look up per call.
        reply = (self.ref._cell.backend or backend()).reply()
        try:
            ask = StartChildAsk(message, args, reply)
            ref, _, failure = await self.ref.ask(ask, timeout=timeout)
        except BaseException:
            reply.discard()  # cancelled: the child may still answer, to nobody
            raise
        if ref is None:
            try:
                await reply.wait(None)  # done: read, so no failed reply is left unread
            except (ActorError, ChildStartFailed):
                pass
            if failure is not None:
                raise failure
            return None
        return ref, await reply.wait(timeout)

    async def terminate_child(self, key: ChildKey, *, timeout: float | None = None) -> None:
        await self.ref.ask(TerminateChild(key), timeout=timeout)

    async def restart_child(
        self, child_id: str, *, timeout: float | None = None
    ) -> ActorRef[Any] | None:
        return await self.ref.ask(RestartChild(child_id), timeout=timeout)

    async def delete_child(self, child_id: str, *, timeout: float | None = None) -> None:
        await self.ref.ask(DeleteChild(child_id), timeout=timeout)

    async def which_children(self, *, timeout: float | None = None) -> list[ChildInfo]:
        return await self.ref.ask(WhichChildren(), timeout=timeout)

    async def count_children(self, *, timeout: float | None = None) -> ChildCount:
        return await self.ref.ask(CountChildren(), timeout=timeout)

    async def get_childspec(self, key: ChildKey, *, timeout: float | None = None) -> ChildSpec:
        return await self.ref.ask(GetChildSpec(key), timeout=timeout)

    async def statistics(self, *, timeout: float | None = None) -> SupervisorStatistics:
        return await self.ref.ask(GetStatistics(), timeout=timeout)

    async def child(self, child_id: str) -> ActorRef[Any]:
        """The ref of the child ``child_id`` (running or not)."""
        for info in await self.which_children():
            if info.id == child_id:
                return info.ref
        raise KeyError(child_id)
