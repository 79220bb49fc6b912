"""Reply streams: a request, then a stream of replies with back-pressure.

The producing handler runs as its own task in the actor; it blocks in :meth:`StreamChannel.send`
once ``buffer`` replies wait unread. The consumer closing the stream early cancels the producer
(so an engine's generator sees the cancellation and aborts its request). A stream always ends
with its terminal item or a typed error, never silently.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import AsyncIterator, Awaitable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from anyio import WouldBlock

from actors._backends import Backend, Parking
from actors._errors import StreamCancelled

if TYPE_CHECKING:
    import anyio

    from actors._timeouts import Deadlines

__all__ = ["ReplyStream", "StreamChannel", "StreamHooks"]

T = TypeVar("T")


class StreamHooks(Protocol):
    """How a channel whose producer lives in another process returns credit and cancels."""

    def consumed(self) -> None: ...

    def cancelled(self) -> None: ...


class StreamChannel:
    """The buffer between one producing handler and one consumer."""

    __slots__ = (
        "_backend",
        "_buffer",
        "_consumer",
        "_producer",
        "_watch",
        "cancelled",
        "capacity",
        "error",
        "finished",
        "hooks",
        "producer_scope",
    )

    def __init__(self, backend: Backend, capacity: int) -> None:
        self._backend = backend
        self._buffer: deque[Any] = deque()
        self.capacity = max(1, capacity)
        self._consumer = backend.parking()
        self._producer = backend.parking()
        self.finished = False
        self.cancelled = False
        self.error: BaseException | None = None
        self.producer_scope: anyio.CancelScope | None = None
        self.hooks: StreamHooks | None = None
        self._watch: _Watch | None = None  # made by the first timed receive

    # -- producer side --------------------------------------------------------------------

    async def send(self, item: Any) -> None:
        while len(self._buffer) >= self.capacity and not self.cancelled:
            await self._producer.park()
        if self.cancelled:
            raise StreamCancelled("the consumer closed the stream")
        self._buffer.append(item)
        self._consumer.unpark()

    def push_many(self, items: list[Any]) -> None:
        """Append without waiting (a remote producer already respects the credit window)."""
        if not self.cancelled:
            self._buffer.extend(items)
            self._consumer.unpark()

    def finish(self) -> None:
        self.finished = True
        self._consumer.unpark()

    def fail(self, error: BaseException) -> None:
        if not self.finished:
            self.error = error
            self.finished = True
            self._consumer.unpark()

    # -- consumer side --------------------------------------------------------------------

    async def receive(self, timeout: float | None = None) -> Any:
        """The next reply; ``StopAsyncIteration`` at the end; the producer's error if it failed;
        ``TimeoutError`` if none came within ``timeout`` seconds (``None``: no limit)."""
        buffer = self._buffer
        if buffer:
            return self._take()
        if timeout is None:
            while not buffer:
                if self.finished:
                    self._raise_end()
                await self._consumer.park()
            return self._take()
        # Timed, in this coroutine (not one more per wait: a stream's consumer waits once per
        # item). No timer per call: the event loop's deadline sweep (the one ask timeouts use)
        # wakes the consumer if nothing came in time, up to two ticks late. Nor an entry in the
        # sweep per wait: the channel's one watch notes this wait's deadline, and files itself
        # only if none of its entries is due by then (one clock read per wait instead).
        watch = self._watch
        if watch is None:
            watch = self._watch = _Watch(self._consumer, self._backend.deadlines)
        deadlines = watch.deadlines
        watch.deadline = deadline = deadlines.now() + timeout
        watch.expired = False
        watch.waiting = True
        if deadline < watch.filed:
            watch.filed = deadline
            deadlines.add(timeout, watch)
        try:
            while not buffer:
                if self.finished:
                    self._raise_end()
                if watch.expired:
                    raise TimeoutError(f"no reply within {timeout} s")
                await self._consumer.park()
        finally:
            watch.waiting = False
        return self._take()

    def _raise_end(self) -> None:
        if self.error is not None:
            raise self.error
        raise StopAsyncIteration

    def receive_nowait(self) -> Any:
        """The next reply if one is buffered, else raise ``anyio.WouldBlock`` (the end of the
        stream and its error are for :meth:`receive` to report)."""
        if not self._buffer:
            raise WouldBlock
        return self._take()

    def _take(self) -> Any:
        item = self._buffer.popleft()
        hooks = self.hooks
        if hooks is None:
            self._producer.unpark()
        else:
            hooks.consumed()  # the producer is in another process
        return item

    def cancel(self) -> None:
        """The consumer is gone: stop the producer."""
        if self.finished and not self._buffer:
            return
        self.cancelled = True
        self.finished = True
        self._buffer.clear()
        self._producer.unpark()
        if self.producer_scope is not None:
            self.producer_scope.cancel()
        if self.hooks is not None:
            self.hooks.cancelled()


class _Watch:
    """A channel's timed receives in the deadline sweep (see ``actors._timeouts``): one per
    channel, not one entry per receive. A receive notes its deadline; an entry that comes due
    before it files the watch again for the rest, so a receive still times out at most two
    ticks late. Between receives the sweep drops the watch's entries, as it drops a finished
    ask's."""

    __slots__ = ("_consumer", "deadline", "deadlines", "expired", "filed", "waiting")

    def __init__(self, consumer: Parking, deadlines: Deadlines) -> None:
        self._consumer = consumer
        self.deadlines = deadlines
        self.deadline = 0.0  # the current (or last) timed receive's, on the sweep's clock
        self.filed = math.inf  # the deadline of the entry last filed, while it is pending
        self.waiting = False  # a timed receive waits
        self.expired = False  # the current timed receive timed out

    @property
    def done(self) -> bool:
        """Read by the sweep, which drops an entry found done: no receive waits then."""
        if self.waiting:
            return False
        self.filed = math.inf  # the next receive files the watch afresh
        return True

    def expire(self) -> None:
        """An entry came due, while a receive waits."""
        left = self.deadline - self.deadlines.now()
        if left > 0:
            self.filed = self.deadline
            self.deadlines.add(left, self)
        else:
            self.filed = math.inf
            self.expired = True
            self._consumer.unpark()


class ReplyStream(Generic[T]):
    """What :meth:`ActorRef.stream` returns: an async iterator, best used as a context manager
    so an early exit cancels the producer at once::

        async with ref.stream(request) as replies:
            async for reply in replies:
                ...
    """

    __slots__ = ("_channel", "_open")

    def __init__(self, channel: StreamChannel) -> None:
        self._channel = channel
        self._open = True

    def __aiter__(self) -> AsyncIterator[T]:
        return self

    def __anext__(self) -> Awaitable[T]:
        # The channel's coroutine itself (one coroutine per item, not two). No bookkeeping on
        # errors: a consumer cancelled here must still cancel the producer when it closes the
        # stream (closing an ended stream is a no-op).
        return self._channel.receive()

    def receive(self, timeout: float | None = None) -> Awaitable[T]:
        """The next reply (``StopAsyncIteration`` at the end); ``TimeoutError`` if none came
        within ``timeout`` seconds (it fires up to two ticks of the deadline sweep late: 20 ms,
        or 1 s for a timeout of 10 s or more; it costs no timer). The channel's coroutine
        itself, as for ``__anext__``."""
        return self._channel.receive(timeout)

    def receive_nowait(self) -> T:
        """The next reply if one is already here, else raise ``anyio.WouldBlock``."""
        item: T = self._channel.receive_nowait()
        return item

    @property
    def buffered(self) -> int:
        """How many replies are here, unread (what :meth:`receive_nowait` can take)."""
        return len(self._channel._buffer)

    def close(self) -> None:
        """Stop consuming; the producing handler is cancelled if still running."""
        if self._open:
            self._open = False
            self._channel.cancel()

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> ReplyStream[T]:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
