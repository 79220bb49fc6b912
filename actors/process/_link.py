"""The ZMQ link between a parent and its process actor, read by a callback.

Two sockets per side, one that only receives (PULL, bound by the parent) and one that only sends
(PUSH): a ZMQ send processes its socket's pending commands and so can consume the FD's wake-up
while a message waits, which forces a socket that does both to re-check ``EVENTS`` after every
send (about 4 us here, on both sides of every round trip). A send-only socket has nothing to lose.

On asyncio the receiving FD is registered once with ``loop.add_reader`` and messages are handled
in the reader callback itself: a reply resolves its caller's future with no task switch. On trio a
task waits on the FD. Each wake-up tries a receive at once (a wake-up almost always means a
message) and reads until ``EVENTS`` shows none left, which re-arms the FD's edge.

:meth:`Link.call_soon` runs a callback once the current task yields (streams batch their items
with it): ``loop.call_soon`` on asyncio, a parked helper task on trio (trio's own ``run_sync_soon``
writes to a wake-up socket every time).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections import deque
from collections.abc import Callable
from typing import Any

import sniffio
import zmq
from zmq.backend import Socket as _RawSocket

from actors._backend import backend
from actors._errors import ActorError
from actors._zmq import context

__all__ = ["Link", "LinkBroken", "new_endpoints"]

MessageHandler = Callable[[bytes], None]

_BACKLOG_RETRY_S = 0.001
_COPY_BELOW = 65536  # larger messages are sent without a copy
_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)
_NOBLOCK = int(zmq.NOBLOCK)
# The backend's methods, skipping pyzmq's pure-Python wrappers (a send through them costs 1.3 us
# here, 0.5 us without).
_send: Any = _RawSocket.send
_recv: Any = _RawSocket.recv
_get: Any = _RawSocket.get


class LinkBroken(ActorError, ConnectionError):
    """The socket to a process actor failed or was closed under us: a typed actor error, so
    callers treat it as the actor being gone."""


class Link:
    """A receiving and a sending socket, the handler of what arrives, and the reader."""

    def __init__(self, on_message: MessageHandler) -> None:
        ctx = context()
        self._rx = ctx.socket(zmq.PULL)
        self._tx = ctx.socket(zmq.PUSH)
        for sock in (self._rx, self._tx):
            sock.setsockopt(zmq.LINGER, 0)
            # Flow control is the actors' job (credits, mailbox capacity): a send never blocks.
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        self._fd = int(self._rx.getsockopt(zmq.FD))
        self._on_message = on_message
        self.closed = False
        self._draining = False
        self._error: BaseException | None = None
        self._wake: Callable[[], None] = _nothing
        # Messages ZMQ would not take yet (EAGAIN: the parent's sending socket is bound, and the
        # child's connection may not be attached yet): sent in order, retried on a timer.
        self._backlog: deque[bytes] = deque()
        self._retry: Callable[[], None] = _nothing
        self._files: list[str] = []  # ipc socket files we bound (ZMQ leaves them behind)
        self._soon: list[Callable[[], None]] = []
        self._run_soon_later: Callable[[], None] = _nothing
        self._before_close: Callable[[], None] = _nothing

    # -- endpoints -------------------------------------------------------------------------

    def bind(self, rx_endpoint: str, tx_endpoint: str) -> tuple[str, str]:
        """Bind both sockets; the resolved endpoints (ports of ``tcp://127.0.0.1:0``)."""
        endpoints = _bind(self._rx, rx_endpoint), _bind(self._tx, tx_endpoint)
        self._files = [e.removeprefix("ipc://") for e in endpoints if e.startswith("ipc://")]
        return endpoints

    def connect(self, rx_endpoint: str, tx_endpoint: str) -> None:
        """Connect to a bound peer: ``rx_endpoint`` is where it sends, ``tx_endpoint`` where it
        receives."""
        self._rx.connect(rx_endpoint)
        self._tx.connect(tx_endpoint)

    # -- sending ---------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        """Queue one message (never blocks)."""
        if self.closed:
            raise LinkBroken("the link is closed")
        if self._backlog or not self._try_send(data):
            self._backlog.append(data)
            if len(self._backlog) == 1:
                self._retry()

    def _try_send(self, data: bytes) -> bool:
        try:
            _send(self._tx, data, _NOBLOCK, len(data) < _COPY_BELOW)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            raise LinkBroken(f"send failed: {exc}") from exc
        return True

    def _flush_backlog(self) -> None:
        backlog = self._backlog
        if not backlog:
            return
        try:
            while backlog and not self.closed and self._try_send(backlog[0]):
                backlog.popleft()
        except LinkBroken as exc:
            self._fail(exc)
            return
        if backlog and not self.closed:
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

    # -- receiving -------------------------------------------------------------------------

    def drain(self) -> None:
        """Handle every message queued now (runs in the event loop thread)."""
        if self._draining or self.closed:
            return
        self._draining = True
        rx = self._rx
        handle = self._on_message
        try:
            while True:
                try:
                    data = _recv(rx, _NOBLOCK)
                except zmq.Again:
                    break  # it processed the socket's commands: the FD will signal what comes
                handle(data)
                if self.closed or not _get(rx, _EVENTS) & _POLLIN:
                    break
        except BaseException as exc:
            self._fail(exc)
        finally:
            self._draining = False

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        self._wake()

    async def run(self) -> None:
        """Read until closed or cancelled; raises what a handler raised."""
        if sniffio.current_async_library() == "trio":
            await self._run_trio()
        else:
            await self._run_asyncio()

    async def _run_asyncio(self) -> None:
        loop = asyncio.get_running_loop()
        stopped = loop.create_future()
        fd = self._fd

        def wake() -> None:
            if not stopped.done():
                stopped.set_result(None)

        def retry() -> None:
            loop.call_later(_BACKLOG_RETRY_S, self._flush_backlog)

        def run_soon_later() -> None:
            loop.call_soon(self._run_soon)

        def before_close() -> None:
            loop.remove_reader(fd)  # before the FD closes (its number may be reused)
            wake()

        self._wake, self._retry, self._run_soon_later = wake, retry, run_soon_later
        self._before_close = before_close
        if self._soon:
            run_soon_later()
        loop.add_reader(fd, self.drain)
        try:
            self._flush_backlog()
            self.drain()
            await stopped
        finally:
            self._before_close = _nothing
            if not self.closed:
                loop.remove_reader(fd)
        if self._error is not None:
            raise self._error

    async def _run_trio(self) -> None:
        import trio

        # One cancel scope for many waits (one per wait would cost about a tenth of a round
        # trip): cancelled to stop, its deadline moved to retry a backlog.
        scope: trio.CancelScope | None = None
        spot = backend().parking()

        def wake() -> None:
            if scope is not None:
                scope.cancel()
            spot.unpark()

        def retry() -> None:
            if scope is not None:
                scope.deadline = min(scope.deadline, trio.current_time() + _BACKLOG_RETRY_S)

        def before_close() -> None:
            trio.lowlevel.notify_closing(self._fd)  # a waiter gets ClosedResourceError

        async def run_soon() -> None:
            while True:
                while self._soon:
                    self._run_soon()
                await spot.park()

        self._wake, self._retry, self._run_soon_later = wake, retry, spot.unpark
        self._before_close = before_close
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_soon)
                while self._error is None and not self.closed:
                    with trio.CancelScope() as scope:
                        while self._error is None and not self.closed:
                            self._flush_backlog()
                            self.drain()
                            try:
                                await trio.lowlevel.wait_readable(self._fd)
                            except trio.ClosedResourceError:
                                break
                    scope = None
                nursery.cancel_scope.cancel()
        finally:
            self._before_close = _nothing
        if self._error is not None:
            raise self._error

    def close(self, linger: float = 0) -> None:
        """Close both sockets; ``linger`` seconds let queued messages (a last EXIT) go out."""
        if not self.closed:
            self.closed = True
            self._before_close()
            self._rx.close(linger=0)
            self._tx.close(linger=int(linger * 1000))
            for path in self._files:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)


def _nothing() -> None:
    pass


def _bind(sock: zmq.Socket[bytes], endpoint: str) -> str:
    if endpoint.endswith(":0"):
        host = endpoint.rsplit(":", 1)[0]
        return f"{host}:{sock.bind_to_random_port(host)}"
    sock.bind(endpoint)
    return endpoint


def new_endpoints(transport: str, name: str) -> tuple[str, str]:
    """Two fresh endpoints (the parent's receiving and sending socket) for ``transport``
    ``"ipc"`` (private socket files) or ``"tcp"`` (loopback, ephemeral ports)."""
    if transport == "tcp":
        return "tcp://127.0.0.1:0", "tcp://127.0.0.1:0"
    base = f"ipc://{tempfile.gettempdir()}/actorserve-{os.getpid()}-{name}"
    return f"{base}-up.sock", f"{base}-down.sock"
