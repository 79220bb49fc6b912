"""Time for supervisors: the real anyio clock, or a virtual one for tests.

Restart intensity and backoff only ever ask for ``now()`` and ``sleep()``, so a test can drive
hours of restart history with :class:`VirtualClock` and no real sleeping.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Protocol

import anyio
import anyio.lowlevel

from actors._backends import Parking, backend

__all__ = ["Clock", "RealClock", "VirtualClock"]


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class RealClock:
    """anyio's clock (trio's MockClock, when a trio test installs one)."""

    def now(self) -> float:
        return anyio.current_time()

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(seconds)


class VirtualClock:
    """A clock that moves only when told to, or, with ``autojump``, jumps to the next sleeper's
    deadline as soon as someone sleeps."""

    def __init__(self, start: float = 0.0, *, autojump: bool = False) -> None:
        self._now = start
        self.autojump = autojump
        self._sleepers: list[tuple[float, int, Parking]] = []
        self._seq = itertools.count()
        self.slept: list[float] = []

    def now(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        deadline = self._now + max(0.0, seconds)
        if self.autojump:
            self.advance_to(deadline)
            await anyio.lowlevel.checkpoint()
            return
        spot = backend().parking()
        heapq.heappush(self._sleepers, (deadline, next(self._seq), spot))
        while self._now < deadline:
            await spot.park()

    def advance(self, seconds: float) -> None:
        """Move time forward, waking every sleeper whose deadline passed."""
        self.advance_to(self._now + seconds)

    def advance_to(self, when: float) -> None:
        self._now = max(self._now, when)
        while self._sleepers and self._sleepers[0][0] <= self._now:
            heapq.heappop(self._sleepers)[2].unpark()

    @property
    def sleepers(self) -> int:
        return len(self._sleepers)
