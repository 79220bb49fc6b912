"""ZMQ sockets usable from any anyio backend (asyncio and trio).

pyzmq's own asyncio integration is asyncio-only, so this waits on the socket's edge-triggered
``FD`` itself. ``EVENTS`` is read before every wait: reading it re-arms the edge, so no wake-up
is lost.

On asyncio the FD is registered with the loop once (``add_reader``), on the first wait, until the
socket closes, and a wait is a future the reader callback resolves: :func:`anyio.wait_readable`
adds and removes a reader per wait, which on uvloop is a poll handle made and closed and five
to seven syscalls per message (``epoll_ctl`` three times, ``ioctl``, ``io_uring_enter``): about
as much as the message's own handling. A wake-up nobody waits for reads ``EVENTS``, which
re-arms the edge (the FD stays readable until then), so a registered but unwaited FD never spins
the loop. On trio, :func:`trio.lowlevel.wait_readable` costs no registration of its own.

Only one task may wait on a socket's FD at a time (``anyio.BusyResourceError`` otherwise), so a
socket has one receiving task; a send that meets the high-water mark polls instead of waiting on
the FD.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import cast

import anyio
import sniffio
import zmq

__all__ = ["AsyncSocket", "context", "has_input"]

_context: zmq.Context[zmq.Socket[bytes]] | None = None


def context() -> zmq.Context[zmq.Socket[bytes]]:
    """The process-wide ZMQ context (created on first use, never pickled across forks)."""
    global _context
    if _context is None or _context.closed:
        _context = zmq.Context()
    return _context


_SEND_RETRY_S = 0.0005


# Plain ints: pyzmq's enum members cost an enum construction per use on this hot path.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


def has_input(sock: zmq.Socket[bytes]) -> bool:
    """Whether a message can be received now (re-arms the FD's edge)."""
    return bool(cast(int, sock.getsockopt(_EVENTS)) & _POLLIN)


class AsyncSocket:
    """An awaitable wrapper around one ``zmq.Socket``; the wrapper owns and closes it."""

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self.socket = sock
        self._fd = int(sock.getsockopt(zmq.FD))
        # asyncio: the loop the FD is registered with (on the first wait), and the waiting
        # task's future. trio: the waiting task's cancel scope.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._waiting: anyio.CancelScope | None = None

    @classmethod
    def create(cls, kind: int, **options: int) -> AsyncSocket:
        sock = context().socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        for name, value in options.items():
            sock.setsockopt(getattr(zmq, name.upper()), value)
        return cls(sock)

    def bind(self, endpoint: str) -> str:
        """Bind and return the resolved endpoint (the port, for ``tcp://127.0.0.1:0``)."""
        if endpoint.endswith(":0"):
            port = self.socket.bind_to_random_port(endpoint.rsplit(":", 1)[0])
            return f"{endpoint.rsplit(':', 1)[0]}:{port}"
        self.socket.bind(endpoint)
        return str(self.socket.getsockopt_string(zmq.LAST_ENDPOINT))

    def connect(self, endpoint: str) -> None:
        self.socket.connect(endpoint)

    async def wait_readable(self) -> None:
        """Return once a message can be received."""
        while not has_input(self.socket):
            if self._waiter is not None or self._waiting is not None:
                raise anyio.BusyResourceError("waiting on this socket")
            loop = self._loop
            if loop is None and sniffio.current_async_library() == "asyncio":
                loop = self._loop = asyncio.get_running_loop()
                loop.add_reader(self._fd, self._on_readable)
            if loop is not None:
                waiter = self._waiter = loop.create_future()
                try:
                    await waiter
                finally:
                    self._waiter = None
            else:
                # A send from another task can consume the FD's edge while a message waits;
                # such a send cancels this scope so the loop re-checks EVENTS.
                try:
                    with anyio.CancelScope() as self._waiting:
                        await anyio.wait_readable(self._fd)
                finally:
                    self._waiting = None

    def _on_readable(self) -> None:
        if self.socket.closed:
            # Closed behind our back (not through close()): stop watching its FD now, before
            # its number is reused.
            self._unregister()
            return
        if not self._wake():
            has_input(self.socket)  # nobody waits: re-arm the edge, so the FD goes quiet

    def _wake(self) -> bool:
        """Wake the waiting task, if any, to re-check ``EVENTS``."""
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            if not waiter.done():
                waiter.set_result(None)
            return True
        if self._waiting is not None:
            self._waiting.cancel()
            return True
        return False

    def recv_multipart_nowait(self) -> list[bytes] | None:
        """One message if one is queued, else ``None``."""
        try:
            return self.socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None

    async def recv_multipart(self) -> list[bytes]:
        while True:
            # EVENTS first: a receive that finds nothing raises (zmq.Again), which costs more.
            await self.wait_readable()
            msg = self.recv_multipart_nowait()
            if msg is not None:
                return msg

    def send_multipart_nowait(
        self, frames: Sequence[bytes | memoryview], copy: bool = True, *, wake: bool = True
    ) -> bool:
        """Send at once; ``False`` when the high-water mark is reached (nothing was sent).

        The send may consume the edge of a message already queued: a task waiting to receive
        is woken to re-check. ``wake=False`` skips that check (one ``EVENTS`` read) for a
        caller that reads ``EVENTS`` itself right after and handles what is queued."""
        try:
            self.socket.send_multipart(frames, zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            return False
        if (
            wake
            and (self._waiter is not None or self._waiting is not None)
            and has_input(self.socket)
        ):
            self._wake()
        return True

    async def send_multipart(self, frames: Sequence[bytes | memoryview], copy: bool = True) -> None:
        # Polling, not waiting on the FD: the receiving task may be waiting on it already.
        while not self.send_multipart_nowait(frames, copy=copy):  # noqa: ASYNC110
            await anyio.sleep(_SEND_RETRY_S)

    def close(self) -> None:
        self._unregister()
        self.socket.close(linger=0)

    def abort(self) -> None:
        """Close now, from the event loop, even while a task waits to receive: that task raises
        ``ClosedResourceError`` (rather than waiting on a dead FD forever). Fault injection
        uses it to model a dropped connection."""
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            if not waiter.done():
                waiter.set_exception(anyio.ClosedResourceError())
        elif self._loop is None:
            anyio.notify_closing(self._fd)
        self.close()

    def _unregister(self) -> None:
        # Before the FD closes: a later socket may get its number.
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self._fd)

    @property
    def closed(self) -> bool:
        return bool(self.socket.closed)
