"""Ask timeouts (and timed stream receives) without a timer per ask.

A timer handle (asyncio) or a cancel scope with a deadline (trio) per ask costs about a third of
a local round trip, and even a clock read per ask is a tenth of a tell. Instead, an ask only
notes its timeout; each event loop sweeps every :data:`TICK` seconds. A sweep stamps the asks
noted since the last one with its own time (at or after they were made, so a deadline is never
early), dropping those already answered (nearly all), and files the rest in one FIFO per distinct
timeout value, whose deadlines only grow: it fails what expired and drops what finished from the
front, and drops a value's FIFO once empty (a timeout left until a deadline takes many values).
Timeouts fire up to two ticks late (the default ask timeout is 5 s). Long ones (at least
:data:`LONG_TIMEOUT`: a request stream's stall and request timeouts, pending all through a
stream) go to a second sweep that ticks every :data:`COARSE_TICK`, so up to 1 s late: a streaming
loop then wakes twice a second for them instead of a hundred times.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["COARSE_TICK", "LONG_TIMEOUT", "TICK", "Deadlines", "aio_deadlines", "trio_deadlines"]

TICK = 0.01
LONG_TIMEOUT = 10.0
COARSE_TICK = 0.5
_COMPACT_AT = 4096  # a long-pending ask at the front keeps finished ones behind it: prune then


class Deadlines:
    """Pending deadlines of one event loop, for objects with ``done`` and ``expire()``."""

    def __init__(
        self, now: Callable[[], float], arm: Callable[[], None], coarse: Deadlines | None = None
    ) -> None:
        self.now = now  # the clock deadlines are counted on
        self._arm = arm
        self._coarse = coarse  # where long timeouts go (see the module docstring)
        self._noted: list[tuple[float, Any]] = []  # (timeout, reply) since the last sweep
        self._queues: dict[float, deque[tuple[float, Any]]] = {}  # (deadline, reply)
        self.armed = False

    def add(self, timeout: float, reply: Any) -> None:
        """Expire ``reply`` after ``timeout`` seconds (and at most two ticks more)."""
        if timeout >= LONG_TIMEOUT and self._coarse is not None:
            self._coarse.add(timeout, reply)
            return
        self._noted.append((timeout, reply))
        if not self.armed:
            self.armed = True
            self._arm()

    def sweep(self) -> bool:
        """Expire what is due; ``True`` while anything is still pending."""
        now = self.now()
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
        # What an expire() noted meanwhile (a stream's watch files itself again) is pending too.
        pending = pending or bool(self._noted)
        self.armed = pending
        return pending


_aio: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Deadlines] = weakref.WeakKeyDictionary()


def aio_deadlines(loop: asyncio.AbstractEventLoop) -> Deadlines:
    deadlines = _aio.get(loop)
    if deadlines is None:
        coarse = _aio_sweep(loop, COARSE_TICK, None)
        deadlines = _aio[loop] = _aio_sweep(loop, TICK, coarse)
    return deadlines


def _aio_sweep(
    loop: asyncio.AbstractEventLoop, tick_s: float, coarse: Deadlines | None
) -> Deadlines:
    def tick() -> None:
        if deadlines.sweep():
            loop.call_later(tick_s, tick)

    def arm() -> None:
        loop.call_later(tick_s, tick)

    deadlines = Deadlines(loop.time, arm, coarse)
    return deadlines


_trio: weakref.WeakKeyDictionary[Any, Deadlines] = weakref.WeakKeyDictionary()


def trio_deadlines() -> Deadlines:
    import trio

    token = trio.lowlevel.current_trio_token()
    deadlines = _trio.get(token)
    if deadlines is None:
        coarse = _trio_sweep(COARSE_TICK, None)
        deadlines = _trio[token] = _trio_sweep(TICK, coarse)
    return deadlines


def _trio_sweep(tick_s: float, coarse: Deadlines | None) -> Deadlines:
    import trio

    async def sweeper() -> None:
        while True:
            await trio.sleep(tick_s)
            if not deadlines.sweep():
                return

    def arm() -> None:
        # A system task: it belongs to the run, not to whichever task asked first.
        trio.lowlevel.spawn_system_task(sweeper, name="actorserve ask timeouts")

    deadlines = Deadlines(trio.current_time, arm, coarse)
    return deadlines
