"""The mailbox: a deque plus one parked receiver.

Items are ``(kind, message, extra)`` tuples: ``extra`` is the reply slot of an ask or the channel of
a stream. Sending never suspends while there is room; the receiver drains without suspending while
items are queued. That keeps a tell well under a microsecond and an ask to two task switches.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from actors._backend import Backend, Parking
from actors._errors import MailboxFull

__all__ = ["ASK", "ASK_ABORTABLE", "STREAM", "TELL", "Mailbox"]

TELL = 0
ASK = 1
STREAM = 2
ASK_ABORTABLE = 3  # an ask from another process: its caller may cancel the running handler

Item = tuple[int, Any, Any]


class Mailbox:
    """A bounded FIFO with back-pressure for many senders and exactly one receiver."""

    __slots__ = (
        "_backend",
        "_closed",
        "_receiver",
        "_space_waiters",
        "capacity",
        "items",
        "put_count",
    )

    def __init__(self, backend: Backend, capacity: int) -> None:
        self._backend = backend
        self.items: deque[Item] = deque()
        self.capacity = capacity
        self._receiver: Parking = backend.parking()
        self._space_waiters: deque[Parking] = deque()
        self._closed = False
        self.put_count = 0

    def __len__(self) -> int:
        return len(self.items)

    @property
    def closed(self) -> bool:
        return self._closed

    def put_nowait(self, item: Item) -> None:
        """Queue ``item``; :class:`MailboxFull` at capacity."""
        if len(self.items) >= self.capacity:
            raise MailboxFull(f"mailbox full ({self.capacity} messages)")
        self.items.append(item)
        self.put_count += 1
        self._receiver.unpark()

    def put_system(self, item: Item) -> None:
        """Queue a runtime message (a Down or Exit notice) regardless of capacity: dropping it
        would break a monitor's promise."""
        if self._closed:
            return
        self.items.append(item)
        self.put_count += 1
        self._receiver.unpark()

    async def put(self, item: Item) -> bool:
        """Queue ``item``, waiting for room; ``False`` if the mailbox closed meanwhile."""
        while len(self.items) >= self.capacity:
            if self._closed:
                return False
            spot = self._backend.parking()
            self._space_waiters.append(spot)
            try:
                await spot.park()
            finally:
                try:
                    self._space_waiters.remove(spot)
                except ValueError:
                    pass
        if self._closed:
            return False
        self.put_nowait(item)
        return True

    def abandon(self, reply: Any) -> None:
        """A local handler runs to completion; its reply is dropped (as OTP's calls)."""

    def pop(self) -> Item:
        item = self.items.popleft()
        if self._space_waiters:
            self._space_waiters[0].unpark()
        return item

    async def wait_nonempty(self) -> None:
        """Park the receiver until something is queued or :meth:`wake` is called."""
        if not self.items:
            await self._receiver.park()

    def wake(self) -> None:
        """Wake the receiver so it re-checks its stop flag."""
        self._receiver.unpark()

    def close(self) -> list[Item]:
        """Refuse further items; return what was still queued."""
        self._closed = True
        left = list(self.items)
        self.items.clear()
        for spot in self._space_waiters:
            spot.unpark()
        return left
