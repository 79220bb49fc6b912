"""Ask timeouts (and timed stream receives) without a timer per ask.

A timer handle (asyncio) or a cancel scope with a deadline (trio) per ask costs about a third of
a local round trip, and even a clock read per ask is a tenth of a tell. Instead, an ask only
notes its timeout; each event loop sweeps every :data:`TICK` seconds. A sweep stamps the asks
noted since the last one with its own time (at or after they were made, so a deadline is never
early), dropping those already answered (nearly all), and files the rest in one FIFO per distinct
timeout value, whose deadlines only grow: it fails what expired and drops what finished from the
front, and drops a value's FIFO once empty (a timeout left until a deadline takes many values).
Timeouts fire up to two ticks late (the default ask timeout is 5 s).
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
    """Pending deadlines of one event loop, for objects with ``done`` and ``expire()``."""

    def __init__(self, now: Callable[[], float], arm: Callable[[], None]) -> None:
        self._now = now
        self._arm = arm
        self._noted: list[tuple[float, Any]] = []  # (timeout, reply) since the last sweep
        self._queues: dict[float, deque[tuple[float, Any]]] = {}  # (deadline, reply)
        self.armed = False

    def add(self, timeout: float, reply: Any) -> None:
        """Expire ``reply`` after ``timeout`` seconds (and at most two ticks more)."""
        self._noted.append((timeout, reply))
        if not self.armed:
            self.armed = True
            self._arm()

    def sweep(self) -> bool:
        """Expire what is due; ``True`` while anything is still pending."""
        now = self._now()
        noted, self._noted = self._noted, []
        queues = self._queues
        for timeout, reply in noted:
            if reply.done:
                continue
            queue = queues.get(timeout)
            if queue is None:
                queue = queues[timeout] = deque()
            queue.append((now + timeout, reply))
            if len(queue) > _COMPACT_AT and len(queue) % _COMPACT_AT == 0:
                live = [entry for entry in queue if not entry[1].done]
                queue.clear()
                queue.extend(live)
        pending = False
        emptied: list[float] = []
        for timeout, queue in queues.items():
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
            if not queue:
                emptied.append(timeout)
        for timeout in emptied:
            # Timeouts computed from a deadline take many values: keep no queue per value.
            del queues[timeout]
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

        deadlines = _trio[token] = Deadlines(trio.current_time, arm)
    return deadlines
