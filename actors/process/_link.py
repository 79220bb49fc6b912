"""One ZMQ DEALER socket between a parent and its process actor, read by a callback.

On asyncio the socket's FD is registered once with ``loop.add_reader`` and frames are handled in
the reader callback itself: a reply resolves its caller's future with no task switch. On trio a
task waits on the FD. A send can consume the FD's edge while frames wait, so after each send the
link re-checks ``EVENTS`` and schedules a drain if needed.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable, Sequence

import sniffio
import zmq

from actors._errors import ActorError
from actors._zmq import context, has_input

__all__ = ["Link", "LinkBroken"]

FrameHandler = Callable[[list[bytes]], None]


_BACKLOG_RETRY_S = 0.001


class LinkBroken(ActorError, ConnectionError):
    """The socket to a process actor failed or was closed under us: a typed actor error, so
    callers treat it as the actor being gone."""


class Link:
    """A DEALER socket, its frame handler, and the reader that feeds it."""

    def __init__(self, on_frames: FrameHandler) -> None:
        self.socket = context().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self._fd = int(self.socket.getsockopt(zmq.FD))
        self._on_frames = on_frames
        self._draining = False
        self._error: BaseException | None = None
        self._kick: Callable[[], None] | None = None
        self._wake: Callable[[], None] = lambda: None
        # Frames ZMQ would not take at once (EAGAIN): sent, in order, as soon as it does.
        self._backlog: deque[Sequence[bytes]] = deque()
        self._retry: Callable[[], None] = lambda: None

    def bind(self, endpoint: str) -> str:
        if endpoint.endswith(":0"):
            host = endpoint.rsplit(":", 1)[0]
            return f"{host}:{self.socket.bind_to_random_port(host)}"
        self.socket.bind(endpoint)
        return endpoint

    def connect(self, endpoint: str) -> None:
        self.socket.connect(endpoint)

    def send(self, frames: Sequence[bytes]) -> None:
        """Queue ``frames`` (never blocks: the high-water mark is off; flow control is the
        actors' job, through credits and mailbox capacity)."""
        if self._backlog or not self._try_send(frames):
            if self.socket.closed:
                raise LinkBroken("the socket is closed")
            self._backlog.append(frames)
        if (
            self._kick is not None
            and not self._draining
            and (self._backlog or has_input(self.socket))
        ):
            self._kick()

    def _try_send(self, frames: Sequence[bytes]) -> bool:
        try:
            self.socket.send_multipart(frames, zmq.NOBLOCK, copy=len(frames[-1]) < 65536)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            raise LinkBroken(f"send failed: {exc}") from exc
        return True

    def _flush(self) -> None:
        backlog = self._backlog
        while backlog and self._try_send(backlog[0]):
            backlog.popleft()

    def drain(self) -> None:
        """Handle every queued message now (runs in the event loop thread)."""
        if self._draining or self.socket.closed:
            return
        self._draining = True
        try:
            sock = self.socket
            self._flush()
            while has_input(sock):
                self._on_frames(sock.recv_multipart(zmq.NOBLOCK, copy=True))
            self._flush()
            if self._backlog:
                self._retry()
        except BaseException as exc:
            if self._error is None:
                self._error = exc
            self._wake()
        finally:
            self._draining = False

    async def run(self) -> None:
        """Read until cancelled; raises what the frame handler raised."""
        if sniffio.current_async_library() == "trio":
            await self._run_trio()
        else:
            await self._run_asyncio()

    async def _run_asyncio(self) -> None:
        loop = asyncio.get_running_loop()
        stopped = loop.create_future()

        def wake() -> None:
            if not stopped.done():
                stopped.set_result(None)

        self._wake = wake

        def kick() -> None:
            loop.call_soon(self.drain)

        def retry() -> None:
            loop.call_later(_BACKLOG_RETRY_S, self.drain)

        self._kick = kick
        self._retry = retry
        loop.add_reader(self._fd, self.drain)
        try:
            self.drain()
            await stopped
        finally:
            self._kick = None
            loop.remove_reader(self._fd)
        if self._error is not None:
            raise self._error

    async def _run_trio(self) -> None:
        import trio

        token = trio.lowlevel.current_trio_token()
        self._kick = lambda: token.run_sync_soon(self.drain)
        try:
            while self._error is None:
                self.drain()
                if self._error is None:
                    # With a backlog, also retry on a timer: the FD may not signal writability.
                    with trio.move_on_after(_BACKLOG_RETRY_S if self._backlog else math.inf):
                        await trio.lowlevel.wait_readable(self._fd)
        finally:
            self._kick = None
        raise self._error

    def close(self, linger: float = 0) -> None:
        """Close the socket; ``linger`` seconds let queued frames (a last EXIT) still go out."""
        self._kick = None
        if not self.socket.closed:
            self.socket.close(linger=int(linger * 1000))


def new_endpoint(transport: str, name: str) -> str:
    """A fresh endpoint for ``transport`` ``"ipc"`` (a private socket file) or ``"tcp"``
    (loopback, ephemeral port)."""
    if transport == "tcp":
        return "tcp://127.0.0.1:0"
    import os
    import tempfile

    return f"ipc://{tempfile.gettempdir()}/actorserve-{os.getpid()}-{name}.sock"
