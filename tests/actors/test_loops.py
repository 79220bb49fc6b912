"""The uvloop loop our processes run on: its timers fire once their deadline has passed."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from actors._backends._loops import run_on
from actors._backends._uvloop import Loop

# Between libuv's millisecond ticks, on them, past them, and already due.
DELAYS = (0.0003, 0.0008, 0.001, 0.0015, 0.005, 0.0109999, 0.0, -0.01)


def test_run_on_uvloop_runs_our_loop() -> None:
    async def loop_type() -> type:
        return type(asyncio.get_running_loop())

    assert run_on("uvloop", loop_type) is Loop


def test_a_timer_fires_only_once_the_clock_reached_its_deadline() -> None:
    async def main() -> list[tuple[float, float]]:
        loop = asyncio.get_running_loop()
        fired: list[tuple[float, float]] = []
        for delay in DELAYS:
            when = loop.time() + delay
            done = asyncio.Event()

            def note(when: float = when, done: asyncio.Event = done) -> None:
                fired.append((when, loop.time()))
                done.set()

            loop.call_at(when, note)
            await done.wait()
        return fired

    fired = run_on("uvloop", main)
    assert len(fired) == len(DELAYS)
    assert all(now >= when for when, now in fired), fired


def test_an_expiring_cancel_scope_arms_its_timer_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # On uvloop's own loop anyio re-arms a timer that fired before the clock reached the
    # deadline, at once and again, until it does: hundreds of timers for one expiry.
    armed: list[float] = []
    call_at = Loop.call_at

    def counting(self: Loop, when: float, *args: object, **kwargs: object) -> object:
        armed.append(when)
        return call_at(self, when, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Loop, "call_at", counting)

    async def main() -> list[int]:
        per_scope = []
        for delay in DELAYS[:6]:
            armed.clear()
            with anyio.move_on_after(delay) as scope:
                await anyio.Event().wait()
            assert scope.cancelled_caught
            per_scope.append(len(armed))
        return per_scope

    assert all(n <= 2 for n in run_on("uvloop", main))
