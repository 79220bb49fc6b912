"""Helpers around the backend's output iterators and the client's connection."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
from starlette.types import Receive

from protocols.engine import EngineOutput
from protocols.errors import StreamIncomplete

__all__ = [
    "CLOSE_TIMEOUT_S",
    "STREAM_ENDED",
    "FrameQueue",
    "aclose_quietly",
    "next_output",
    "ready_output",
    "until_disconnected",
]

log = logging.getLogger("actorserve.frontend")

T = TypeVar("T")

#: How long a backend iterator may take to clean up (send its abort) once closed.
CLOSE_TIMEOUT_S = 5.0
#: What a :class:`StreamIncomplete` says of an iterator that ended before its finish reason.
STREAM_ENDED = "the output stream ended without a finish reason"


async def next_output(outputs: AsyncIterator[EngineOutput]) -> EngineOutput:
    """The next output; an iterator that ends before its finish reason is a truncated stream."""
    try:
        return await outputs.__anext__()
    except StopAsyncIteration:
        raise StreamIncomplete(STREAM_ENDED) from None


async def aclose_quietly(outputs: AsyncIterator[EngineOutput]) -> None:
    """Close the backend's iterator (its cue to abort the request), shielded and bounded; with
    its ``close()`` if it has one.

    Shielded: this runs while the request is being cancelled, and the backend's cleanup must be
    able to await (send the abort). Bounded: a backend that hangs in cleanup must not hold the
    connection forever. Errors are logged, not raised: the request is over either way.
    """
    close = getattr(outputs, "close", None)
    if close is not None:
        # It closes without waiting (see Backend): no cancel scope, no timer.
        try:
            close()
        except Exception as exc:
            log.warning("backend output stream failed to close cleanly", exc_info=exc)
        return
    aclose = getattr(outputs, "aclose", None)
    if aclose is None:
        return
    with anyio.move_on_after(CLOSE_TIMEOUT_S, shield=True) as scope:
        try:
            await aclose()
        except Exception as exc:
            log.warning("backend output stream failed to close cleanly", exc_info=exc)
    if scope.cancelled_caught:
        log.warning("backend output stream took over %.0f s to close", CLOSE_TIMEOUT_S)


async def until_disconnected(
    receive: Receive, fn: Callable[[], Awaitable[T]]
) -> tuple[T | None, bool]:
    """Run ``fn`` unless the client disconnects first, which cancels it.

    Returns ``(result, False)``, or ``(None, True)`` when the client went away. Exceptions of
    ``fn`` propagate as they are (not wrapped in an exception group).
    """
    result: T | None = None
    error: Exception | None = None
    disconnected = False
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            nonlocal disconnected
            # The body was read already, so the next message is the disconnect.
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected = True
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            result = await fn()
        except Exception as exc:
            error = exc
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return (None, True) if disconnected else (result, False)


def _nothing_ready() -> EngineOutput | None:
    return None


def ready_output(outputs: AsyncIterator[EngineOutput]) -> Callable[[], EngineOutput | None]:
    """A function giving an output of ``outputs`` that is already here (``None`` if none is):
    the iterator's own ``next_nowait`` if it has one (see
    :class:`~actors.serving.frontend.Backend`)."""
    poll: Callable[[], EngineOutput | None] | None = getattr(outputs, "next_nowait", None)
    return poll if poll is not None else _nothing_ready


class FrameQueue:
    """Where the choices of a request with several put their frames, and its one writer takes
    them: the writer's task alone writes to the client, so failing or cancelling a choice's task
    never cuts a write in half."""

    __slots__ = ("_frames", "_wake", "closed")

    def __init__(self) -> None:
        self._frames: list[bytes] = []
        self._wake: anyio.Event | None = None
        self.closed = False

    async def put(self, frames: bytes) -> None:
        """Queue ``frames`` (the signature of a writer's ``send``; it never waits)."""
        self._frames.append(frames)
        self._notify()

    def close(self) -> None:
        """No more frames come."""
        self.closed = True
        self._notify()

    async def take(self) -> bytes:
        """Every frame queued, once there is one or the queue is closed (then maybe none)."""
        while not self._frames and not self.closed:
            wake = self._wake = anyio.Event()
            await wake.wait()
        taken = b"".join(self._frames)
        self._frames.clear()
        return taken

    def _notify(self) -> None:
        wake, self._wake = self._wake, None
        if wake is not None:
            wake.set()
