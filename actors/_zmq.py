"""ZMQ sockets usable from any anyio backend (asyncio and trio).

pyzmq's own asyncio integration is asyncio-only, so this waits on the socket's edge-triggered
``FD`` with :func:`anyio.wait_readable`. ``EVENTS`` is read before every wait: reading it re-arms
the edge, so no wake-up is lost.

Only one task may wait on a socket's FD at a time (anyio raises ``BusyResourceError`` otherwise),
so a socket has one receiving task; a send that meets the high-water mark polls instead of
waiting on the FD.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import anyio
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
        self._waiting: anyio.CancelScope | None = None
        self._fd = int(sock.getsockopt(zmq.FD))

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
            # A send from another task can consume the FD's edge while a message waits; such a
            # send cancels this scope so the loop re-checks EVENTS.
            with anyio.CancelScope() as self._waiting:
                await anyio.wait_readable(self._fd)
            self._waiting = None

    def recv_multipart_nowait(self) -> list[bytes] | None:
        """One message if one is queued, else ``None``."""
        try:
            return self.socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None

    async def recv_multipart(self) -> list[bytes]:
        while True:
            msg = self.recv_multipart_nowait()
            if msg is not None:
                return msg
            await self.wait_readable()

    def send_multipart_nowait(
        self, frames: Sequence[bytes | memoryview], copy: bool = True
    ) -> bool:
        """Send at once; ``False`` when the high-water mark is reached (nothing was sent)."""
        try:
            self.socket.send_multipart(frames, zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            return False
        if self._waiting is not None and has_input(self.socket):
            self._waiting.cancel()
        return True

    async def send_multipart(self, frames: Sequence[bytes | memoryview], copy: bool = True) -> None:
        # Polling, not waiting on the FD: the receiving task may be waiting on it already.
        while not self.send_multipart_nowait(frames, copy=copy):  # noqa: ASYNC110
            await anyio.sleep(_SEND_RETRY_S)

    def close(self) -> None:
        self.socket.close(linger=0)

    def abort(self) -> None:
        """Close now, from the event loop, even while a task waits to receive: that task raises
        ``ClosedResourceError`` (rather than waiting on a dead FD forever). Fault injection
        uses it to model a dropped connection."""
        anyio.notify_closing(self._fd)
        self.close()

    @property
    def closed(self) -> bool:
        return bool(self.socket.closed)
