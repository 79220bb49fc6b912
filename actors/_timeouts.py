"""Ask timeouts without a timer per ask.

A timer handle (asyncio) or a cancel scope with a deadline (trio) per ask costs about a third of
a local round trip. Instead, each event loop keeps one FIFO per distinct timeout value: deadlines
in a FIFO only grow, so one sweep every :data:`TICK` seconds fails what expired and drops what
finished, from the front. Timeouts fire up to one tick late (the default ask timeout is 5 s).
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["TICK", "Deadlines", "aio_deadlines", "trio_deadlines"]

TICK = 0.01
_COMPACT_AT = 4096  # a long-pending ask at the front keeps finished ones behind it: prune then


class Deadlines:
    """Pending deadlines of one event loop: ``(when, expired?, expire)`` entries per timeout."""

    def __init__(self, now: Callable[[], float], arm: Callable[[], None]) -> None:
        self._now = now
        self._arm = arm
        self._queues: dict[float, deque[tuple[float, Any]]] = {}
        self.armed = False

    def add(self, timeout: float, reply: Any) -> None:
        """Expire ``reply`` (an object with ``done`` and ``expire()``) after ``timeout``."""
        queue = self._queues.get(timeout)
        if queue is None:
            queue = self._queues[timeout] = deque()
        queue.append((self._now() + timeout, reply))
        if len(queue) > _COMPACT_AT and len(queue) % _COMPACT_AT == 0:
            live = [entry for entry in queue if not entry[1].done]
            queue.clear()
            queue.extend(live)
        if not self.armed:
            self.armed = True
            self._arm()

    def sweep(self) -> bool:
        """Expire what is due; ``True`` while anything is still pending."""
        now = self._now()
        pending = False
        for queue in self._queues.values():
            while queue:
                when, reply = queue[0]
                if reply.done:
                    queue.popleft()
                elif when <= now:
                    queue.popleft()
                    reply.expire()
                else:
                    pending = True
                    break
        self.armed = pending
        return pending


_aio: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Deadlines] = weakref.WeakKeyDictionary()


def aio_deadlines(loop: asyncio.AbstractEventLoop) -> Deadlines:
    deadlines = _aio.get(loop)
    if deadlines is None:

        def tick() -> None:
            if deadlines is not None and deadlines.sweep():
                loop.call_later(TICK, tick)

        def arm() -> None:
            loop.call_later(TICK, tick)

        deadlines = _aio[loop] = Deadlines(loop.time, arm)
    return deadlines


_trio: weakref.WeakKeyDictionary[Any, Deadlines] = weakref.WeakKeyDictionary()


def trio_deadlines() -> Deadlines:
    import trio

    token = trio.lowlevel.current_trio_token()
    deadlines = _trio.get(token)
    if deadlines is None:

        async def sweeper() -> None:
            assert deadlines is not None
            while True:
                await trio.sleep(TICK)
                if not deadlines.sweep():
                    return

        def arm() -> None:
            # A system task: it belongs to the run, not to whichever task asked first.
            trio.lowlevel.spawn_system_task(sweeper, name="actorserve ask timeouts")

        # The run's clock itself: trio.current_time reaches it through two more calls.
        now = trio.lowlevel.current_clock().current_time
        deadlines = _trio[token] = Deadlines(now, arm)
    return deadlines
