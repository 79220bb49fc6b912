"""Actor references.

An :class:`ActorRef` names an actor, not one incarnation of it: it points at a :class:`Cell` that
the supervisor re-binds on every restart, so a ref never goes stale silently. A call on an actor
that is not running fails at once with a typed error (or, for an actor waiting to restart, waits a
bounded time when its child spec says so).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar, overload

import attrs

from actors._backends import Backend, Parking
from actors._errors import (
    ActorCrashed,
    ActorNotRunning,
    ActorRestarting,
    AskTimeout,
)
from actors._exit import ExitReason
from actors._mailbox import ASK, STREAM, TELL, Item
from actors._stream import ReplyStream, StreamChannel

if TYPE_CHECKING:
    from actors._runtime import Incarnation

__all__ = [
    "DEFAULT_ASK_TIMEOUT",
    "ActorRef",
    "ActorStatistics",
    "Call",
    "Cell",
    "CellState",
    "Down",
    "Inbox",
    "Monitor",
    "WhileRestarting",
]

R = TypeVar("R")
T = TypeVar("T")
DEFAULT_ASK_TIMEOUT = 5.0  # gen_server:call's default


class Call(Generic[R]):
    """Base for request messages whose reply type is ``R``: ``await ref.ask(msg)`` is then typed."""

    __slots__ = ()


class CellState(enum.Enum):
    INIT = "init"  # never started
    RUNNING = "running"
    RESTARTING = "restarting"  # the supervisor will start a new incarnation
    DEAD = "dead"  # exited and not coming back (or deleted)


@attrs.frozen
class WhileRestarting:
    """What a call does while its actor waits to be restarted: fail at once (``"fail"``), or wait
    up to ``timeout`` seconds for the new incarnation (``"wait"``)."""

    mode: Literal["fail", "wait"] = "fail"
    timeout: float = 1.0

    def __attrs_post_init__(self) -> None:
        if self.mode not in ("fail", "wait") or not self.timeout >= 0:
            raise ValueError("WhileRestarting needs mode 'fail' or 'wait' and timeout >= 0")


_FAIL = WhileRestarting()  # the default, shared (frozen): one per cell costs a tenth of a Cell


@attrs.frozen
class Down:
    """Delivered to a monitor when the monitored actor's incarnation ends."""

    ref: ActorRef[Any]
    reason: ExitReason


@attrs.frozen
class ActorStatistics:
    name: str
    state: str
    incarnation: int
    restarts: int
    mailbox_size: int
    mailbox_capacity: int
    messages_received: int


class Inbox(Protocol):
    """Where a running incarnation takes messages: a local mailbox or a remote proxy."""

    capacity: int
    put_count: int

    def __len__(self) -> int: ...

    def try_put(self, item: Item) -> bool:
        """Queue ``item`` unless that would wait for room (then ``False``, nothing queued)."""
        ...

    def put_nowait(self, item: Item) -> None: ...

    def put_system(self, item: Item) -> None: ...

    async def put(self, item: Item) -> bool: ...

    def abandon(self, reply: Any) -> None:
        """The caller of an ask gave up (timeout or cancellation)."""


ExitListener = Callable[[ExitReason], None]


class Cell:
    """The mutable binding behind a ref: current inbox, state, exit listeners.

    ``inbox`` is set exactly while the state is ``RUNNING``: the hot path checks only it.
    """

    __slots__ = (
        "_bind_waiters",
        "backend",
        "inbox",
        "incarnation",
        "last_exit",
        "listeners",
        "name",
        "restarts",
        "runtime",
        "state",
        "while_restarting",
    )

    def __init__(self, name: str, while_restarting: WhileRestarting | None = None) -> None:
        self.name = name
        self.state = CellState.INIT
        self.inbox: Inbox | None = None
        self.backend: Backend | None = None
        self.runtime: Incarnation | None = None
        self.incarnation = 0
        self.restarts = 0
        self.last_exit: ExitReason | None = None
        self.listeners: dict[int, ExitListener] = {}
        self.while_restarting = while_restarting or _FAIL
        self._bind_waiters: list[Parking] = []

    def bind(self, inbox: Inbox, backend: Backend, runtime: Incarnation | None) -> None:
        if self.incarnation:
            self.restarts += 1
        self.incarnation += 1
        self.inbox = inbox
        self.backend = backend
        self.runtime = runtime
        self.state = CellState.RUNNING
        self._wake_bind_waiters()

    def unbind(self, reason: ExitReason, next_state: CellState) -> None:
        """End the current incarnation: notify listeners once, then move to ``next_state``."""
        self.inbox = None
        self.runtime = None
        self.last_exit = reason
        self.state = next_state
        listeners, self.listeners = self.listeners, {}
        for listener in listeners.values():
            listener(reason)
        if next_state is not CellState.RESTARTING:
            self._wake_bind_waiters()

    def set_state(self, state: CellState) -> None:
        self.state = state
        if state is not CellState.RUNNING:
            self.inbox = None
        if state is not CellState.RESTARTING:
            self._wake_bind_waiters()

    def _wake_bind_waiters(self) -> None:
        waiters, self._bind_waiters = self._bind_waiters, []
        for spot in waiters:
            spot.unpark()

    def not_running_error(self) -> ActorNotRunning:
        if self.state is CellState.RESTARTING:
            return ActorRestarting(self.name, self.last_exit)
        return ActorNotRunning(self.name, self.last_exit)

    async def wait_running(self) -> Inbox:
        """The inbox of a running incarnation, waiting per :class:`WhileRestarting`."""
        policy = self.while_restarting
        if self.state is CellState.RESTARTING and policy.mode == "wait":
            import anyio

            from actors._backends import backend

            with anyio.move_on_after(policy.timeout):
                while self.state is CellState.RESTARTING:
                    spot = backend().parking()
                    self._bind_waiters.append(spot)
                    await spot.park()
        if self.state is not CellState.RUNNING or self.inbox is None:
            raise self.not_running_error()
        return self.inbox


_monitor_ids = iter(range(1, math.ceil(1e18)))


class Monitor:
    """A one-shot watch on an actor's current incarnation (see :meth:`ActorRef.monitor`)."""

    __slots__ = ("_cell", "_id", "_reason", "_spot", "ref")

    def __init__(self, ref: ActorRef[Any]) -> None:
        from actors._backends import backend

        self.ref = ref
        self._cell = ref._cell
        self._reason: ExitReason | None = None
        self._spot = backend().parking()
        self._id = next(_monitor_ids)
        if self._cell.state is CellState.RUNNING:
            self._cell.listeners[self._id] = self._fire
        else:
            self._reason = self._cell.last_exit or ExitReason.killed("noproc")

    def _fire(self, reason: ExitReason) -> None:
        self._reason = reason
        self._spot.unpark()

    async def wait(self) -> Down:
        """Wait for the incarnation to end."""
        while self._reason is None:
            await self._spot.park()
        return Down(self.ref, self._reason)

    def cancel(self) -> None:
        """Stop watching (OTP's demonitor)."""
        self._cell.listeners.pop(self._id, None)


class ActorRef(Generic[R]):
    """A stable address of an actor: ``tell``, ``ask`` and ``stream`` to it.

    Valid across restarts of the actor it names. The type parameter is informational (the kind of
    messages it takes); replies are typed through :class:`Call`.
    """

    __slots__ = ("_cell",)

    def __init__(self, cell: Cell) -> None:
        self._cell = cell

    @property
    def name(self) -> str:
        return self._cell.name

    @property
    def is_running(self) -> bool:
        """Running, and not already known to be dying."""
        cell = self._cell
        return cell.state is CellState.RUNNING and not (
            cell.runtime is not None and cell.runtime.dying
        )

    def __repr__(self) -> str:
        return f"<ActorRef {self._cell.name} {self._cell.state.value}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ActorRef) and other._cell is self._cell

    def __hash__(self) -> int:
        return id(self._cell)

    def tell_nowait(self, message: Any) -> None:
        """Send without waiting: :class:`MailboxFull` at capacity, a typed error if not running."""
        inbox = self._cell.inbox
        if inbox is None:
            raise self._cell.not_running_error()
        inbox.put_nowait((TELL, message, None))

    async def tell(self, message: Any) -> None:
        """Send, waiting while the mailbox is full (back-pressure); a schedule point only then."""
        # The hot path: one attribute walk to the inbox and one call (see Cell.inbox).
        inbox = self._cell.inbox
        if inbox is None:
            inbox = await self._cell.wait_running()
        item = (TELL, message, None)
        if not inbox.try_put(item) and not await inbox.put(item):
            raise self._cell.not_running_error()

    @overload
    async def ask(self, message: Call[T], *, timeout: float | None = ...) -> T: ...

    @overload
    async def ask(self, message: object, *, timeout: float | None = ...) -> Any: ...

    async def ask(self, message: Any, *, timeout: float | None = DEFAULT_ASK_TIMEOUT) -> Any:
        """Send ``message`` and wait for the handler's return value.

        Raises :class:`AskTimeout` after ``timeout`` seconds (``None``: no limit),
        :class:`ActorCrashed` if the actor dies first, the handler's :class:`ReplyError` as is.
        """
        cell = self._cell
        inbox = cell.inbox
        if inbox is None:
            inbox = await cell.wait_running()
        backend = cell.backend
        assert backend is not None  # bound with the inbox
        reply = backend.reply()
        item = (ASK, message, reply)
        if not inbox.try_put(item):
            timeout = await _put_within(cell, inbox, item, timeout)
        try:
            return await reply.wait(timeout)
        except TimeoutError:
            inbox.abandon(reply)
            raise AskTimeout(f"no reply from {cell.name!r} within {timeout} s") from None
        except BaseException:
            inbox.abandon(reply)  # cancelled: a remote handler is aborted
            raise

    def stream(self, message: Any, *, buffer: int = 16) -> ReplyStream[Any]:
        """Send ``message`` to the actor's stream handler; iterate the replies.

        At most ``buffer`` replies wait unread before the handler blocks (back-pressure).
        """
        cell = self._cell
        inbox = cell.inbox
        if inbox is None or cell.backend is None:
            raise cell.not_running_error()
        channel = StreamChannel(cell.backend, buffer)
        inbox.put_system((STREAM, message, channel))
        return ReplyStream(channel)

    async def wait_running(self, *, after: int = 0) -> None:
        """Return once an incarnation newer than ``after`` runs (``after=0``: any).

        Pass ``ref.statistics().incarnation`` to wait for a restart. Raises
        :class:`ActorNotRunning` if the actor ends up dead instead.
        """
        from actors._backends import backend

        cell = self._cell
        while not (cell.state is CellState.RUNNING and cell.incarnation > after):
            if cell.state is CellState.DEAD:
                raise cell.not_running_error()
            spot = backend().parking()
            cell._bind_waiters.append(spot)
            await spot.park()

    def monitor(self) -> Monitor:
        """Watch the current incarnation; ``await monitor.wait()`` gives its :class:`Down`."""
        return Monitor(self)

    def statistics(self) -> ActorStatistics:
        cell = self._cell
        inbox = cell.inbox
        return ActorStatistics(
            name=cell.name,
            state=cell.state.value,
            incarnation=cell.incarnation,
            restarts=cell.restarts,
            mailbox_size=len(inbox) if inbox is not None else 0,
            mailbox_capacity=inbox.capacity if inbox is not None else 0,
            messages_received=inbox.put_count if inbox is not None else 0,
        )


async def _put_within(cell: Cell, inbox: Inbox, item: Item, timeout: float | None) -> float | None:
    """Wait for mailbox room within the ask's ``timeout``; return what is left of it."""
    import anyio

    start = anyio.current_time()
    with anyio.move_on_after(math.inf if timeout is None else timeout):
        if not await inbox.put(item):
            raise cell.not_running_error()
        return None if timeout is None else max(0.0, timeout - (anyio.current_time() - start))
    raise AskTimeout(f"no room in {cell.name!r}'s mailbox within {timeout} s")


def crash_error(name: str, reason: ExitReason) -> Exception:
    """The error a pending call gets when its actor's incarnation ends."""
    if reason.is_abnormal:
        return ActorCrashed(name, reason)
    return ActorNotRunning(name, reason)
