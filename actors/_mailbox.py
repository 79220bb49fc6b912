"""The mailbox: a deque plus one parked receiver.

Items are ``(kind, message, extra)`` tuples: ``extra`` is the reply slot of an ask or the channel of
a stream. Sending never suspends while there is room; the receiver drains without suspending while
items are queued. That keeps a tell well under a microsecond and an ask to two task switches.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable
from typing import Any

from actors._backends import Backend, Parking
from actors._errors import MailboxFull

__all__ = ["ASK", "ASK_ABORTABLE", "INJECTED", "STREAM", "TELL", "Mailbox"]

TELL = 0
ASK = 1
STREAM = 2
ASK_ABORTABLE = 3  # an ask from another process: its caller may cancel the running handler
# A fault a test injects (actors.testing): an async callable the serve loop awaits in place of a
# handler, so it crashes or blocks the actor as a handler would, with no help from the actor.
INJECTED = 4

Item = tuple[int, Any, Any]


class Mailbox:
    """A bounded FIFO with back-pressure for many senders and exactly one receiver.

    The receiver (the serve loop) pops :attr:`items` itself and, for each item it takes, pops and
    wakes the first of :attr:`space_waiters`: a method call per message costs a tenth of a tell.
    """

    __slots__ = (
        "_backend",
        "_closed",
        "_parked",
        "_receiver",
        "capacity",
        "items",
        "put_count",
        "space_waiters",
    )

    def __init__(self, backend: Backend, capacity: int) -> None:
        self._backend = backend
        self.items: deque[Item] = deque()
        self.capacity = capacity
        self._receiver: Parking = backend.parking()
        self._parked = False  # the receiver waits in wait_nonempty: a put must wake it
        self.space_waiters: deque[Parking] = deque()
        self._closed = False
        self.put_count = 0

    def __len__(self) -> int:
        return len(self.items)

    @property
    def closed(self) -> bool:
        return self._closed

    def try_put(self, item: Item) -> bool:
        """Queue ``item`` if there is room; ``False`` (nothing queued) at capacity."""
        items = self.items
        if len(items) >= self.capacity:
            return False
        items.append(item)
        self.put_count += 1
        if self._parked:  # checked here: a call per put would cost a tenth of a tell
            self.wake()
        return True

    def put_nowait(self, item: Item) -> None:
        """Queue ``item``; :class:`MailboxFull` at capacity."""
        if not self.try_put(item):
            raise MailboxFull(f"mailbox full ({self.capacity} messages)")

    def put_system(self, item: Item) -> None:
        """Queue a runtime message (a Down or Exit notice) regardless of capacity: dropping it
        would break a monitor's promise."""
        if self._closed:
            return
        self.items.append(item)
        self.put_count += 1
        if self._parked:  # as in try_put: wake, inlined (a process actor's every message)
            self._parked = False
            self._receiver.unpark()

    async def put(self, item: Item) -> bool:
        """Queue ``item``, waiting for room; ``False`` if the mailbox closed meanwhile."""
        while len(self.items) >= self.capacity:
            if self._closed:
                return False
            spot = self._backend.parking()
            self.space_waiters.append(spot)
            try:
                await spot.park()
            except BaseException:
                try:
                    self.space_waiters.remove(spot)
                except ValueError:
                    # Woken for a free slot, then cancelled: hand the slot to the next sender.
                    self._wake_sender()
                raise
        if self._closed:
            return False
        self.put_nowait(item)
        return True

    def _wake_sender(self) -> None:
        if self.space_waiters and len(self.items) < self.capacity:
            self.space_waiters.popleft().unpark()

    def abandon(self, reply: Any) -> None:
        """A local handler runs to completion; its reply is dropped (as OTP's calls)."""

    def wait_nonempty(self) -> Awaitable[None]:
        """Await it to park the receiver, which found no items, until something is queued or
        :meth:`wake` is called."""
        # Only a waker clears the flag: left set by a cancelled receiver, it costs a put one
        # wake-up of nobody, while a receiver parked with it clear would never be woken.
        self._parked = True
        return self._receiver.park()

    def wake(self) -> None:
        """Wake the receiver (to take an item, or to re-check its stop flag)."""
        if self._parked:
            self._parked = False
            self._receiver.unpark()

    def close(self) -> list[Item]:
        """Refuse further items; return what was still queued."""
        self._closed = True
        left = list(self.items)
        self.items.clear()
        while self.space_waiters:
            self.space_waiters.popleft().unpark()
        return left
