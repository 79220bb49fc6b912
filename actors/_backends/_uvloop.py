"""uvloop's loop, its timers aligned to its clock (imported only where uvloop runs).

uvloop's clock and timers both count libuv's whole milliseconds: ``call_at(when)`` with ``when``
between two ticks fires at the earlier one, while ``loop.time()`` is still short of ``when``.
anyio's cancel scopes re-arm such a timer for the rest, which is again less than a tick, so every
``move_on_after`` / ``fail_after`` that expires busy-loops until the clock ticks past its deadline:
up to a millisecond of CPU per expiry. A timer here fires at the first tick at or after ``when``
instead: once.
"""

from __future__ import annotations

import math
from asyncio import TimerHandle
from collections.abc import Callable
from contextvars import Context
from typing import TypeVarTuple

import uvloop

__all__ = ["Loop"]

_TICK_S = 0.001  # libuv's timer and clock grain
_Ts = TypeVarTuple("_Ts")


class Loop(uvloop.Loop):
    def call_at(
        self,
        when: float,
        callback: Callable[[*_Ts], object],
        *args: *_Ts,
        context: Context | None = None,
    ) -> TimerHandle:
        ticks = math.ceil((when - self.time()) / _TICK_S)
        handle: TimerHandle = super().call_later(
            max(0, ticks) * _TICK_S, callback, *args, context=context
        )
        return handle
