"""The SSE response: a producer writes the status line (or an error response), then the frames.

Our own, not sse-starlette's: a stream is one task for the producer plus one that watches for the
client leaving, and nothing else per request or per frame (sse-starlette runs three tasks, a
send lock and a cancel scope per request; its per-request cost was as large as the rest of our
frontend's).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable

import anyio
import anyio.lowlevel
import sniffio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

__all__ = ["SSEResponse", "SSEWriter"]

_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    # No cache may store a stream; proxies must not buffer it (nginx reads X-Accel-Buffering).
    (b"cache-control", b"no-store"),
    (b"connection", b"keep-alive"),
    (b"x-accel-buffering", b"no"),
]
PING_FRAME = b": ping\n\n"


class SSEWriter:
    """What the producer of an :class:`SSEResponse` writes to.

    First :meth:`start`, once: ``None`` opens the event stream (status 200), a Starlette
    ``Response`` is sent instead of it (an error found before the first frame keeps its own
    status code) and ends the response. Then :meth:`send` frames and :meth:`end` with the last
    one. ``disconnected`` tells whether the client went away (the producer is then cancelled).
    """

    __slots__ = ("_ended", "_extra", "_scope", "_send", "_started", "_wake", "disconnected")

    def __init__(
        self, send: Send, scope: anyio.CancelScope, extra: list[tuple[bytes, bytes]]
    ) -> None:
        self._send = send
        self._scope = scope
        self._extra = extra  # headers added to the stream's or the error response's
        # Flags, not events: only the pings wait for them (with an event of their own).
        self._started = False
        self._ended = False
        self._wake: anyio.Event | None = None
        self.disconnected = False

    async def start(self, head: Response | None = None) -> None:
        if head is None:
            headers = [*_HEADERS, *self._extra] if self._extra else _HEADERS
            await self._write({"type": "http.response.start", "status": 200, "headers": headers})
            self._started = True
            self._notify()
            return
        self._end()
        start = {"type": "http.response.start", "status": head.status_code}
        await self._write({**start, "headers": [*head.raw_headers, *self._extra]})
        await self._write({"type": "http.response.body", "body": head.body, "more_body": False})

    async def send(self, frames: bytes) -> None:
        """Send one or more frames now (as one body chunk: one write, one TCP segment)."""
        # The per-chunk path: the server's send awaited here, not through _write (a coroutine
        # less per chunk).
        try:
            await self._send({"type": "http.response.body", "body": frames, "more_body": True})
        except OSError:
            await self._client_gone()
            raise

    async def end(self, frames: bytes) -> None:
        """Send the last frames and end the response."""
        self._end()
        await self._write({"type": "http.response.body", "body": frames, "more_body": False})

    async def _write(self, message: dict[str, object]) -> None:
        try:
            await self._send(message)
        except OSError:
            await self._client_gone()
            raise

    async def _client_gone(self) -> None:
        # ASGI 2.4 servers raise OSError for a send after the client left: that is the client
        # going away, so the producer is cancelled as if the watcher had seen it.
        self._stop(disconnected=True)
        await anyio.lowlevel.checkpoint()

    def _end(self) -> None:
        self._ended = True
        self._notify()

    def _notify(self) -> None:
        wake, self._wake = self._wake, None
        if wake is not None:
            wake.set()

    def _stop(self, *, disconnected: bool) -> None:
        self.disconnected = disconnected
        self._end()
        self._scope.cancel()

    async def _watch(self, receive: Receive) -> None:
        # The body was read already: the next message is the disconnect, which servers also
        # send once the response is complete (then it is no news and ends this task).
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self._ended:
            self._stop(disconnected=True)

    async def _ping(self, interval: float) -> None:
        while not self._started and not self._ended:
            wake = self._wake = anyio.Event()
            await wake.wait()
        while not self._ended:
            wake = self._wake = anyio.Event()
            with anyio.move_on_after(interval):
                await wake.wait()
            if not self._ended:
                await self.send(PING_FRAME)


Producer = Callable[[SSEWriter], Awaitable[None]]


class SSEResponse(Response):
    """A ``text/event-stream`` response written by ``produce``, which gets an :class:`SSEWriter`.

    The producer runs in the response's task; a client that leaves cancels it, wherever it
    waits (the first output included), and ``writer.disconnected`` is then true. ``ping_s > 0``
    sends SSE comments (``: ping``) every ``ping_s`` seconds once the status line is out, for
    proxies that cut idle connections. No server-exit watcher: the server's graceful shutdown
    lets in-flight streams finish, then cancels them.
    """

    def __init__(self, produce: Producer, *, ping_s: float = 0.0) -> None:
        # Starlette's Response.__init__ would render a body and headers we never use; here,
        # raw_headers are those added to whatever is sent: the stream, or an error response.
        self.raw_headers = []
        self.status_code = 200
        self.background = None
        self._produce = produce
        self._ping_s = ping_s if ping_s > 0 else math.inf

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._ping_s == math.inf and sniffio.current_async_library() == "asyncio":
            await self._run_watched(receive, send)
        else:
            await self._run_in_task_group(receive, send)
        if self.background is not None:
            await self.background()

    async def _run_watched(self, receive: Receive, send: Send) -> None:
        # The watcher as a plain asyncio task: an anyio task group and task cost about five
        # times as much CPU as the rest of this method (measured), for one helper that never
        # raises. It never outlives the response: cancelled (if still waiting) and awaited.
        with anyio.CancelScope() as scope:
            writer = SSEWriter(send, scope, self.raw_headers)
            watcher = asyncio.get_running_loop().create_task(writer._watch(receive))
            try:
                await self._produce(writer)
            finally:
                if not writer._ended:
                    writer._stop(disconnected=writer.disconnected)  # the producer failed
                watcher.cancel()
                with anyio.CancelScope(shield=True):
                    await asyncio.wait((watcher,))

    async def _run_in_task_group(self, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                writer = SSEWriter(send, tg.cancel_scope, self.raw_headers)
                tg.start_soon(writer._watch, receive)
                if self._ping_s != math.inf:
                    tg.start_soon(writer._ping, self._ping_s)
                try:
                    await self._produce(writer)
                finally:
                    if not writer._ended:
                        # The producer failed before the end: stop the watcher and the pings.
                        writer._stop(disconnected=writer.disconnected)
        except BaseExceptionGroup as group:
            # Only the producer raises (the watcher and the pings never do): re-raise its error
            # as it is, not wrapped, like any other endpoint's.
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
