"""The trio side of :mod:`actors._backends`: parking on ``wait_task_rescheduled``.

trio's lowlevel functions are bound here once, as module globals, so the hot path pays neither
an attribute walk through ``trio.lowlevel`` nor a lookup of the backend per call.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from outcome import Error, Value
from trio.lowlevel import Abort, checkpoint, current_task, reschedule, wait_task_rescheduled

from actors._backends import Parking, Reply
from actors._timeouts import Deadlines, trio_deadlines

__all__ = ["ABANDONED", "TrioBackend"]

_PENDING: Any = object()
ABANDONED = TimeoutError("the waiter was cancelled")
_SUCCEEDED = Abort.SUCCEEDED


class _TrioParking:
    __slots__ = ("_task",)

    def __init__(self) -> None:
        self._task: Any = None

    def unpark(self) -> None:
        task = self._task
        if task is not None:
            self._task = None
            reschedule(task)

    def _abort(self, _: Any) -> Abort:
        self._task = None
        return _SUCCEEDED

    def park(self) -> Awaitable[None]:
        self._task = current_task()
        return wait_task_rescheduled(self._abort)  # noqa: ASYNC105 (awaited by the parker)


class _TrioReply:
    __slots__ = ("_deadlines", "_error", "_task", "_value", "kick", "reader")

    def __init__(self, deadlines: Deadlines) -> None:
        self._value: Any = _PENDING
        self._error: BaseException | None = None
        self._task: Any = None
        self._deadlines = deadlines
        # Set by a process actor's link: it may wait for the reply by reading the socket in the
        # waiter's task (see Link.read_for); then ``kick`` ends that wait.
        self.reader: Callable[[_TrioReply], Awaitable[Any] | None] | None = None
        self.kick: Callable[[], None] | None = None

    def set(self, value: Any) -> None:
        if self._value is _PENDING and self._error is None:
            self._value = value
            task = self._task
            if task is not None:
                self._task = None
                reschedule(task, Value(value))
            elif self.kick is not None:
                self.kick()

    def fail(self, error: BaseException) -> None:
        if self._value is _PENDING and self._error is None:
            self._error = error
            task = self._task
            if task is not None:
                self._task = None
                reschedule(task, Error(error))
            elif self.kick is not None:
                self.kick()

    @property
    def done(self) -> bool:
        return self._value is not _PENDING or self._error is not None

    def expire(self) -> None:
        self.fail(TimeoutError())

    def discard(self) -> None:
        if self._value is _PENDING and self._error is None:
            self._error = ABANDONED

    def _abort(self, _: Any) -> Abort:
        self._task = None
        # The waiter is gone (cancelled): done, so a pending deadline does not outlive it.
        if self._value is _PENDING and self._error is None:
            self._error = ABANDONED
        return _SUCCEEDED

    def wait(self, timeout: float | None) -> Awaitable[Any]:
        if self._value is _PENDING and self._error is None:
            if timeout is not None:
                self._deadlines.add(timeout, self)
            if self.reader is not None:
                reading = self.reader(self)
                if reading is not None:
                    return reading
            self._task = current_task()
            # set and fail hand their outcome to trio's own wait: no coroutine of ours between.
            return wait_task_rescheduled(self._abort)  # noqa: ASYNC105 (awaited by the asker)
        return self._outcome()

    async def _outcome(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value


class TrioBackend:
    name = "trio"

    def __init__(self) -> None:
        self.deadlines = trio_deadlines()

    def parking(self) -> Parking:
        return _TrioParking()

    def reply(self) -> Reply:
        return _TrioReply(self.deadlines)

    async def yield_now(self) -> None:
        await checkpoint()
