"""Backend-native wake-ups for the hot path.

anyio's memory streams cost 36-53 us per request/reply on these machines; the mailbox, replies
and reply streams instead park one task on a bare asyncio future or trio's
``wait_task_rescheduled``. Every user re-checks its condition before parking, so a wake-up with
nobody parked is simply dropped.

:class:`Parking` is a spot for one waiting task; :class:`Reply` a one-shot result with a timeout.
``backend()`` picks the implementation for the running event loop once.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import sniffio

from actors._timeouts import aio_deadlines, trio_deadlines

__all__ = ["Backend", "Parking", "Reply", "backend"]

_PENDING: Any = object()
_ABANDONED = TimeoutError("the waiter was cancelled")


class Parking(Protocol):
    """Where one task waits until another wakes it."""

    def unpark(self) -> None: ...

    async def park(self) -> None: ...


class Reply(Protocol):
    """A one-shot result: set once (value or error), awaited once."""

    def set(self, value: Any) -> None: ...

    def fail(self, error: BaseException) -> None: ...

    @property
    def done(self) -> bool: ...

    async def wait(self, timeout: float | None) -> Any:
        """The value, or raise the error; ``TimeoutError`` after ``timeout`` seconds."""
        ...


class Backend(Protocol):
    name: str

    def parking(self) -> Parking: ...

    def reply(self) -> Reply: ...

    async def yield_now(self) -> None:
        """Let other tasks run (cheaper than anyio's checkpoint on the hot path)."""
        ...


# -- asyncio ---------------------------------------------------------------------------------


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

    async def park(self) -> None:
        fut = self._loop.create_future()
        self._fut = fut
        try:
            await fut
        finally:
            if self._fut is fut:
                self._fut = None


class _AioReply:
    __slots__ = ("_fut", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._fut: asyncio.Future[Any] = loop.create_future()

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

    async def wait(self, timeout: float | None) -> Any:
        fut = self._fut
        if timeout is not None and not fut.done():
            aio_deadlines(self._loop).add(timeout, self)
        return await fut


class _AioBackend:
    name = "asyncio"

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def parking(self) -> Parking:
        return _AioParking(self.loop)

    def reply(self) -> Reply:
        return _AioReply(self.loop)

    async def yield_now(self) -> None:
        await asyncio.sleep(0)


# -- trio ------------------------------------------------------------------------------------


class _TrioParking:
    __slots__ = ("_task",)

    def __init__(self) -> None:
        self._task: Any = None

    def unpark(self) -> None:
        task = self._task
        if task is not None:
            self._task = None
            _trio_lowlevel().reschedule(task)

    def _abort(self, _: Any) -> Any:
        self._task = None
        return _trio_lowlevel().Abort.SUCCEEDED

    async def park(self) -> None:
        lowlevel = _trio_lowlevel()
        self._task = lowlevel.current_task()
        await lowlevel.wait_task_rescheduled(self._abort)


class _TrioReply:
    __slots__ = ("_error", "_task", "_value")

    def __init__(self) -> None:
        self._value: Any = _PENDING
        self._error: BaseException | None = None
        self._task: Any = None

    def set(self, value: Any) -> None:
        if self._value is _PENDING and self._error is None:
            self._value = value
            self._wake()

    def fail(self, error: BaseException) -> None:
        if self._value is _PENDING and self._error is None:
            self._error = error
            self._wake()

    def _wake(self) -> None:
        task = self._task
        if task is not None:
            self._task = None
            _trio_lowlevel().reschedule(task)

    @property
    def done(self) -> bool:
        return self._value is not _PENDING or self._error is not None

    def expire(self) -> None:
        self.fail(TimeoutError())

    def _abort(self, _: Any) -> Any:
        self._task = None
        # The waiter is gone (cancelled): done, so a pending deadline does not outlive it.
        if not self.done:
            self._error = _ABANDONED
        return _trio_lowlevel().Abort.SUCCEEDED

    async def wait(self, timeout: float | None) -> Any:
        if not self.done:
            lowlevel = _trio_lowlevel()
            if timeout is not None:
                trio_deadlines().add(timeout, self)
            self._task = lowlevel.current_task()
            await lowlevel.wait_task_rescheduled(self._abort)
        if self._error is not None:
            raise self._error
        return self._value


_lowlevel: Any = None


def _trio_lowlevel() -> Any:
    global _lowlevel
    if _lowlevel is None:
        import trio

        _lowlevel = trio.lowlevel
    return _lowlevel


class _TrioBackend:
    name = "trio"

    def parking(self) -> Parking:
        return _TrioParking()

    def reply(self) -> Reply:
        return _TrioReply()

    async def yield_now(self) -> None:
        await _trio_lowlevel().checkpoint()


def backend() -> Backend:
    """The implementation for the running event loop."""
    if sniffio.current_async_library() == "trio":
        return _TrioBackend()
    return _AioBackend(asyncio.get_running_loop())
