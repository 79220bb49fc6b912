"""The link between a parent and its process actor: messages over sockets, read by a callback.

A message is a kind, a correlation id and a body (see :mod:`actors.process._frames`): each
transport frames the three its own way, so a send packs them in one go. A received body is the
handler's to keep: never a view of a buffer the link reuses (a decoded ``msgspec.Raw`` or
``memoryview`` field would still point into it).

Two transports behind one :class:`Link`:

- ``"unix"`` (the default, :mod:`actors.process._link_unix`): one Unix-domain stream socket with
  length-prefixed messages, read and written straight by the event loop's thread: a message
  costs one send and one receive (besides the loop's wait), and no thread hand-off.
- ``"ipc"`` and ``"tcp"`` (``tcp://127.0.0.1``, the cross-host path;
  :mod:`actors.process._link_zmq`): ZMQ PUSH/PULL sockets, one ZMQ frame per message. ZMQ's I/O
  thread adds two thread hand-offs per direction.

On asyncio the receiving FD is registered once with ``loop.add_reader`` and messages are handled
in the reader callback itself: a reply resolves its caller's future with no task switch. On trio a
task waits on the FD, under one cancel scope for many waits (one per wait would cost about a
tenth of a round trip); while only replies are awaited, it stands by and a lone asker reads its
reply off the socket itself (:meth:`Link.read_for`).

A send never blocks: what the socket will not take yet waits in a backlog, flushed as the socket
becomes writable (unix) or on a timer (ZMQ, whose FD only signals input). A link breaks when its
socket does (the peer closed its end, a reset, a failed send): :meth:`Link.run` raises
:class:`LinkBroken`, and sends are dropped from then on (their replies cannot arrive; the link's
owner reacts to the error).

:meth:`Link.call_soon` runs a callback once the current task yields (streams batch their items
with it): ``loop.call_soon`` on asyncio, a parked helper task on trio (trio's own ``run_sync_soon``
writes to a wake-up socket every time).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Literal

import sniffio

from actors._backends import Parking, backend
from actors._errors import ActorError
from actors.process._frames import Body

__all__ = ["Link", "LinkBroken", "Transport", "connect_link", "new_link"]

Transport = Literal["unix", "ipc", "tcp"]
# (kind, corr, body): the body is the handler's to keep (see the module docstring).
MessageHandler = Callable[[int, int, Body], None]
Chunk = bytes | bytearray | memoryview

_BACKLOG_RETRY_S = 0.001


class LinkBroken(ActorError, ConnectionError):
    """The socket to a process actor failed or was closed under us: a typed actor error, so
    callers treat it as the actor being gone."""


def new_link(transport: Transport, on_message: MessageHandler) -> Link:
    """The parent's end of a link over ``transport``, not bound yet (see :meth:`Link.bind`)."""
    if transport == "unix":
        from actors.process._link_unix import UnixLink

        return UnixLink(on_message)
    if transport in ("ipc", "tcp"):
        from actors.process._link_zmq import ZmqLink

        return ZmqLink(on_message, transport)
    raise ValueError(f"unknown transport {transport!r}: expected 'unix', 'ipc' or 'tcp'")


def connect_link(endpoints: list[str], on_message: MessageHandler) -> Link:
    """The child's end of a link: connected to the endpoints its parent's :meth:`Link.bind`
    returned (their scheme names the transport)."""
    link: Link
    if endpoints[0].startswith("unix://"):
        from actors.process._link_unix import UnixLink

        link = UnixLink(on_message)
    else:
        from actors.process._link_zmq import ZmqLink

        link = ZmqLink(on_message, "tcp" if endpoints[0].startswith("tcp://") else "ipc")
    link.connect(endpoints)
    return link


class Link:
    """One end of a link: its sockets, the handler of what arrives, and the reader.

    Subclasses provide the socket work: ``bind``/``connect``, ``send``, ``_read`` (handle what is
    queued now), ``_write_backlog`` and ``_close``; this class runs it on asyncio or trio.
    """

    # Flush the backlog when the FD is writable (else retry on a timer).
    _flush_on_writable = False
    # trio: an asker may wait on the FD for its own reply (see read_for). Not over ZMQ, whose FD
    # signals edges: an asker arriving after an unread message would wait for nothing.
    _asker_reads = False

    def __init__(self, on_message: MessageHandler) -> None:
        self._fd = -1  # waited on for input (and for room to send, with _flush_on_writable)
        self._on_message = on_message
        self.closed = False
        self.broken = False
        # The peer's end is closed and everything it sent has been handled: nothing more can
        # arrive (a unix link; ZMQ never tells).
        self.peer_closed = False
        self._draining = False
        self._error: BaseException | None = None
        self._wake: Callable[[], None] = _nothing
        # What the socket would not take yet, in order: whole messages (ZMQ) or the rest of a
        # byte stream (unix).
        self._backlog: deque[Chunk] = deque()
        self._retry: Callable[[], None] = _nothing
        self._soon: list[Callable[[], None]] = []
        self._run_soon_later: Callable[[], None] = _nothing
        self._before_close: Callable[[], None] = _nothing
        # trio: who waits on the FD now (the link's task, an asker, or nobody), and where the
        # link's task stands by meanwhile (see read_for).
        self._reader: object | None = None
        self._standby: Parking | None = None
        self._kick: Callable[[], None] = _nothing
        # Set by the owner: nothing it awaits can arrive unasked (no stream, no start), so the
        # link's task may stand by and leave reading to a lone asker.
        self.idle: Callable[[], bool] = _never

    # -- the transport's part ----------------------------------------------------------------

    def bind(self, name: str) -> list[str]:
        """Bind fresh private endpoints; what the peer passes to :func:`connect_link`."""
        raise NotImplementedError

    def connect(self, endpoints: list[str]) -> None:
        raise NotImplementedError

    def send(self, kind: int, corr: int = 0, body: bytes = b"") -> None:
        """Queue one message (never blocks); ``LinkBroken`` once the link is closed. On a broken
        link the message is dropped: :meth:`run` raises the error."""
        raise NotImplementedError

    async def _wait_peer(self) -> None:
        """Until the peer's connection is there (a listening transport accepts it)."""

    def _read(self) -> None:
        """Handle every message queued now."""
        raise NotImplementedError

    def _write_backlog(self) -> bool:
        """Send what the socket takes; whether the backlog is empty (``LinkBroken`` on a
        failure)."""
        raise NotImplementedError

    def _close(self, linger: float) -> None:
        raise NotImplementedError

    # -- shared ----------------------------------------------------------------------------

    def _usable(self) -> bool:
        """Whether a send can go out: raises once closed, ``False`` once broken."""
        if self.closed:
            raise LinkBroken("the link is closed")
        return not self.broken

    def _flush_backlog(self) -> None:
        if not self._backlog or self.closed or self.broken:
            return
        try:
            done = self._write_backlog()
        except LinkBroken as exc:
            self._fail(exc)
            return
        if not done:
            self._retry()

    def call_soon(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the current task yields (in order, once per call)."""
        self._soon.append(callback)
        if len(self._soon) == 1:
            self._run_soon_later()

    def _run_soon(self) -> None:
        callbacks, self._soon = self._soon, []
        if self.closed:
            return  # what they would send has nowhere to go
        try:
            for callback in callbacks:
                callback()
        except BaseException as exc:
            self._fail(exc)

    def drain(self) -> None:
        """Handle every message queued now (runs in the event loop thread)."""
        if self._draining or self.closed or self.peer_closed:
            return
        self._draining = True
        try:
            self._read()
        except BaseException as exc:
            self._fail(exc)
        finally:
            self._draining = False

    def _fail(self, exc: BaseException) -> None:
        if isinstance(exc, LinkBroken):
            self.broken = True
            self._backlog.clear()
        if self._error is None:
            self._error = exc
        self._wake()

    async def run(self) -> None:
        """Read until closed or cancelled; raises what a handler raised, or ``LinkBroken``."""
        await self._wait_peer()
        if self.closed:
            return
        try:
            if sniffio.current_async_library() == "trio":
                await self._run_trio()
            else:
                await self._run_asyncio()
        finally:
            self._wake = self._retry = self._run_soon_later = self._before_close = _nothing
        if self._error is not None:
            raise self._error

    async def _run_asyncio(self) -> None:
        loop = asyncio.get_running_loop()
        stopped = loop.create_future()
        fd = self._fd
        writing = False

        def wake() -> None:
            if not stopped.done():
                stopped.set_result(None)

        def on_writable() -> None:
            nonlocal writing
            self._flush_backlog()
            if writing and not self._backlog:
                loop.remove_writer(fd)
                writing = False

        def retry() -> None:
            nonlocal writing
            if not self._flush_on_writable:
                loop.call_later(_BACKLOG_RETRY_S, self._flush_backlog)
            elif not writing:
                loop.add_writer(fd, on_writable)
                writing = True

        def unregister() -> None:
            nonlocal writing
            loop.remove_reader(fd)  # before the FD closes (its number may be reused)
            if writing:
                loop.remove_writer(fd)
                writing = False

        def before_close() -> None:
            unregister()
            wake()

        def run_soon_later() -> None:
            loop.call_soon(self._run_soon)

        self._wake, self._retry, self._run_soon_later = wake, retry, run_soon_later
        self._before_close = before_close
        if self._soon:
            run_soon_later()
        loop.add_reader(fd, self.drain)
        try:
            self._flush_backlog()
            self.drain()
            if self._error is None:
                await stopped
        finally:
            if not self.closed:
                unregister()

    async def _run_trio(self) -> None:
        import trio

        # One cancel scope for many waits: cancelled to stop, its deadline moved to retry a
        # backlog on a timer.
        scope: trio.CancelScope | None = None
        soon = backend().parking()
        writer = backend().parking()
        standby = self._standby = backend().parking()
        fd = self._fd
        self._kick = partial(trio.lowlevel.notify_closing, fd)

        def wake() -> None:
            if scope is not None:
                scope.cancel()
            soon.unpark()
            writer.unpark()
            standby.unpark()

        def retry() -> None:
            if self._flush_on_writable:
                writer.unpark()
            elif scope is not None:
                scope.deadline = min(scope.deadline, trio.current_time() + _BACKLOG_RETRY_S)

        def before_close() -> None:
            trio.lowlevel.notify_closing(fd)  # a waiter gets ClosedResourceError
            standby.unpark()

        async def run_soon() -> None:
            while True:
                while self._soon:
                    self._run_soon()
                await soon.park()

        async def flush_when_writable() -> None:
            while True:
                while self._backlog and not self.broken:
                    try:
                        await trio.lowlevel.wait_writable(fd)
                    except trio.ClosedResourceError:
                        if self.closed:
                            return
                        continue  # an asker reading the FD was kicked (see read_for)
                    self._flush_backlog()
                await writer.park()

        self._wake, self._retry, self._run_soon_later = wake, retry, soon.unpark
        self._before_close = before_close
        wait_readable = trio.lowlevel.wait_readable
        # Standing by leaves reading to askers: only where they may (see read_for).
        idle = self.idle if self._asker_reads else _never
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_soon)
                if self._flush_on_writable:
                    nursery.start_soon(flush_when_writable)
                while self._error is None and not self.closed:
                    with trio.CancelScope() as scope:
                        while self._error is None and not self.closed:
                            if self._backlog:
                                self._flush_backlog()
                            if self._reader is None:
                                self.drain()
                            if self._reader is not None or idle():
                                await standby.park()  # an asker reads, or nothing is awaited
                                continue
                            self._reader = self
                            try:
                                await wait_readable(fd)
                            except trio.ClosedResourceError:
                                break
                            finally:
                                self._reader = None
                    scope = None
                nursery.cancel_scope.cancel()
        finally:
            self._standby = None

    def read_for(self, reply: Any) -> Awaitable[Any] | None:
        """trio: an awaitable that waits for ``reply`` (the trio reply of an ask over this link)
        by reading the socket in the asker's own task, if nobody waits on it now; ``None``
        otherwise (the asker parks as usual).

        Read by the link's task, a reply costs its asker a wake-up and trio a scheduling round;
        read by the asker, one wait. The link's task stands by
        while nothing but replies is awaited (:attr:`idle`) and reads again once an asker
        leaves with something else pending. A reply settled another way while its asker waits
        on the socket (a timeout, a crash) ends that wait through ``notify_closing``, trio's
        public way to wake a waiter with ``ClosedResourceError``: the socket stays open (trio
        registers a waited-on FD afresh), and the link's writer task waits again if woken too.
        """
        if not self._asker_reads or self._reader is not None or self._standby is None:
            return None
        if self._error is not None or self.closed:
            return None
        return self._read_for(reply)

    async def _read_for(self, reply: Any) -> Any:
        import trio

        from actors._backends._trio import ABANDONED

        self._reader = reply
        fd, kick = self._fd, self._kick
        try:
            while not reply.done and self._error is None and not self.closed:
                reply.kick = kick
                try:
                    await trio.lowlevel.wait_readable(fd)
                except trio.ClosedResourceError:
                    pass  # kicked (its reply was settled another way), or the link is closing
                finally:
                    reply.kick = None
                self.drain()
        except BaseException:
            reply.fail(ABANDONED)  # cancelled: done, so its deadline does not outlive it
            raise
        finally:
            self._reader = None
            if self._standby is not None and not self.idle():
                self._standby.unpark()  # something else is awaited: the link's task reads
        reply.reader = None
        return await reply.wait(None)  # its outcome, or parked until the link's task has it

    def resume_reading(self) -> None:
        """trio: something that arrives unasked is now awaited (a stream's items): the link's
        task reads again, once no asker does."""
        if self._standby is not None:
            self._standby.unpark()

    def drain_unread(self) -> None:
        """Handle what arrived while nobody read (trio: the link's task stood by, no asker
        waited); a no-op while a task waits on the socket."""
        if self._reader is None and self._standby is not None:
            self.drain()

    @property
    def may_stand_by(self) -> bool:
        """Whether what arrives may wait unread for :meth:`drain_unread` (trio; on asyncio the
        loop's reader callback handles every message as it comes)."""
        return self._standby is not None

    def close(self, linger: float = 0) -> None:
        """Close the sockets; ``linger`` seconds let queued messages (a last EXIT) go out."""
        if not self.closed:
            self.closed = True
            self._before_close()
            self._close(linger)


def _nothing() -> None:
    pass


def _never() -> bool:
    return False
