"""Backend-native wake-ups for the hot path.

anyio's memory streams cost several times a bare wake-up per request/reply; the mailbox, replies
and reply streams instead park one task on a bare asyncio future or trio's
``wait_task_rescheduled``. Every user re-checks its condition before parking, so a wake-up with
nobody parked is simply dropped.

:class:`Parking` is a spot for one waiting task; :class:`Reply` a one-shot result with a timeout.
``backend()`` picks the implementation for the running event loop; the trio one lives in
:mod:`actors._backends._trio`, imported on first use so asyncio users never import trio.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, Protocol

import sniffio

from actors._timeouts import Deadlines, aio_deadlines

__all__ = ["Backend", "Parking", "Reply", "backend"]


class Parking(Protocol):
    """Where one task waits until another wakes it."""

    def unpark(self) -> None: ...

    def park(self) -> Awaitable[None]:
        """Await it at once to wait (a future or trio's wait itself: no coroutine of ours)."""
        ...


class Reply(Protocol):
    """A one-shot result: set once (value or error), awaited once."""

    def set(self, value: Any) -> None: ...

    def fail(self, error: BaseException) -> None: ...

    @property
    def done(self) -> bool: ...

    def wait(self, timeout: float | None) -> Awaitable[Any]:
        """Await it for the value, or the error; ``TimeoutError`` after ``timeout`` seconds."""
        ...

    def discard(self) -> None:
        """Nobody will wait for it: drop its outcome, come or to come (asyncio would otherwise
        log an error nobody read)."""
        ...


class Backend(Protocol):
    name: str
    deadlines: Deadlines  # the event loop's timeout sweep (see actors._timeouts)

    def parking(self) -> Parking: ...

    def reply(self) -> Reply: ...

    async def yield_now(self) -> None:
        """Let other tasks run (cheaper than anyio's checkpoint on the hot path)."""
        ...


_Future = asyncio.Future  # made directly: loop.create_future is one more Python call


class _AioParking:
    __slots__ = ("_fut", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._fut: asyncio.Future[None] | None = None

    def unpark(self) -> None:
        fut = self._fut
        if fut is not None:
            self._fut = None
            if not fut.done():
                fut.set_result(None)

    def park(self) -> Awaitable[None]:
        # A waiter cancelled meanwhile leaves its future here, done: unpark skips it.
        fut: asyncio.Future[None] = _Future(loop=self._loop)
        self._fut = fut
        return fut


class _AioReply:
    __slots__ = ("_deadlines", "_fut")

    def __init__(self, loop: asyncio.AbstractEventLoop, deadlines: Deadlines) -> None:
        self._fut: asyncio.Future[Any] = _Future(loop=loop)
        self._deadlines = deadlines

    def set(self, value: Any) -> None:
        if not self._fut.done():
            self._fut.set_result(value)

    def fail(self, error: BaseException) -> None:
        if not self._fut.done():
            self._fut.set_exception(error)

    @property
    def done(self) -> bool:
        return self._fut.done()

    def expire(self) -> None:
        if not self._fut.done():
            self._fut.set_exception(TimeoutError())

    def discard(self) -> None:
        fut = self._fut
        if not fut.done():
            fut.cancel()  # what comes later is dropped
        elif not fut.cancelled():
            fut.exception()  # read: never logged as unretrieved

    def wait(self, timeout: float | None) -> Awaitable[Any]:
        # The future itself: the asker awaits it with no coroutine of ours in between.
        fut = self._fut
        if timeout is not None and not fut.done():
            self._deadlines.add(timeout, self)
        return fut


class _AioBackend:
    name = "asyncio"

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        # Looked up once here, not per ask (the per-loop registry is a weak mapping).
        self.deadlines = aio_deadlines(loop)

    def parking(self) -> Parking:
        return _AioParking(self.loop)

    def reply(self) -> Reply:
        return _AioReply(self.loop, self.deadlines)

    async def yield_now(self) -> None:
        await asyncio.sleep(0)


def backend() -> Backend:
    """The implementation for the running event loop."""
    if sniffio.current_async_library() == "trio":
        from actors._backends._trio import TrioBackend

        return TrioBackend()
    return _AioBackend(asyncio.get_running_loop())
