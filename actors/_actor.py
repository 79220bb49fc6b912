"""The :class:`Actor` base class: handlers, lifecycle hooks, links and monitors."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from actors._errors import ReplyError, UnhandledMessage
from actors._exit import ExitReason
from actors._mailbox import TELL
from actors._ref import ActorRef, CellState, Down, Inbox

if TYPE_CHECKING:
    import anyio.abc

    from actors._runtime import Incarnation

__all__ = ["Actor", "Exit", "LinkedExit"]


@attrs.frozen
class Exit:
    """Delivered to an actor with ``trap_exits`` when a linked actor exits, for any reason
    (``normal`` included: OTP's ``{'EXIT', Pid, Reason}``)."""

    ref: ActorRef[Any]
    reason: ExitReason


class LinkedExit(Exception):
    """Why an actor died when an actor it is linked to died (and it does not trap exits): the
    ``error`` of its exit reason, whose kind is the linked actor's (OTP's exit signal)."""

    def __init__(self, ref: ActorRef[Any], reason: ExitReason) -> None:
        super().__init__(f"linked actor {ref.name!r} exited: {reason}")
        self.ref = ref
        self.reason = reason


class Actor:
    """Subclass and override :meth:`receive` (tell and ask) and/or :meth:`receive_stream`.

    An actor handles its mailbox one message at a time; each stream request runs as its own task
    so a long stream does not block the mailbox. An exception of a type in ``reply_errors`` answers
    the caller and the actor goes on; any other exception crashes the actor, and its supervisor
    decides what happens next.
    """

    reply_errors: ClassVar[tuple[type[BaseException], ...]] = (ReplyError,)
    trap_exits: ClassVar[bool] = False
    mailbox_capacity: ClassVar[int] = 65536

    _runtime: Incarnation

    # -- hooks --------------------------------------------------------------------------------

    async def started(self) -> None:
        """Runs before the actor counts as started; raise to fail the start (or
        :class:`~actors.Ignore`)."""

    async def stopping(self, reason: ExitReason) -> None:
        """Runs once when the incarnation ends for any reason but a kill."""

    async def receive(self, message: Any) -> Any:
        """Handle a tell or an ask; the return value is an ask's reply."""
        if isinstance(message, Down | Exit):
            return None
        raise UnhandledMessage(f"{type(self).__name__} got unexpected {type(message).__name__}")

    def receive_stream(self, message: Any) -> AsyncIterator[Any]:
        """Handle a stream request: an async generator of replies."""
        raise ReplyError(f"{type(self).__name__} does not serve streams")

    def inbox_override(self) -> Inbox | None:
        """Where callers' messages go instead of the mailbox (process actors forward them to
        their OS process); ``None`` for ordinary actors."""
        return None

    # -- inside the actor ---------------------------------------------------------------------

    @property
    def ref(self) -> ActorRef[Any]:
        """This actor's own ref."""
        return self._runtime.ref

    @property
    def task_group(self) -> anyio.abc.TaskGroup:
        """Tasks started here live no longer than this incarnation."""
        self._runtime.spawned = True
        return self._runtime.task_group

    def start_soon(
        self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any, name: str | None = None
    ) -> None:
        """Run ``fn(*args)`` as a task of this actor; if it raises, the actor crashes."""
        self._runtime.spawned = True
        self._runtime.task_group.start_soon(fn, *args, name=name)

    def stop(self, reason: ExitReason | None = None) -> None:
        """Exit after the current message (default reason ``normal``)."""
        self._runtime.request_stop(reason or ExitReason.normal())

    @property
    def stop_requested(self) -> bool:
        """True once a graceful stop began: long handlers and streams should wind up."""
        return self._runtime.stop_reason is not None

    def monitor(self, ref: ActorRef[Any]) -> int:
        """Receive :class:`Down` in :meth:`receive` when ``ref``'s incarnation ends."""
        return self._runtime.watch(ref, lambda reason: Down(ref, reason))

    def demonitor(self, ref: ActorRef[Any], monitor_id: int) -> None:
        self._runtime.unwatch(ref._cell, monitor_id)

    def link(self, ref: ActorRef[Any]) -> None:
        """Tie this incarnation's fate to ``ref``'s (both ways): when either exits other than
        ``normal``, the other dies too with that reason's kind, or gets :class:`Exit` if it
        traps exits."""
        self._runtime.link(ref)


def deliver_notice(runtime: Incarnation, notice: Any) -> None:
    """Queue a Down or Exit notice for the actor owning ``runtime`` (never dropped)."""
    if runtime.ref._cell.state is CellState.RUNNING:
        runtime.mailbox.put_system((TELL, notice, None))
