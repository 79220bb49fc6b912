"""The demo tree ``actorserve run --demo`` starts: a few actors doing small, visible work."""

from __future__ import annotations

import random
from typing import Any

import anyio

from actors import Actor, current_registry
from supervisors._spec import Backoff, ChildSpec, Restart, Strategy, SupervisorFlags
from supervisors._supervisor import Supervisor

__all__ = ["demo_tree"]


class Counter(Actor):
    """Counts the ticks it is told about; answers ``"count"``."""

    def __init__(self) -> None:
        self.count = 0

    async def receive(self, message: Any) -> Any:
        if message == "tick":
            self.count += 1
            return None
        if message == "count":
            return self.count
        return await super().receive(message)


class Ticker(Actor):
    """Tells the counter every ``period`` seconds; crashes now and then to show restarts."""

    def __init__(self, period: float = 0.5, crash_every: int = 20) -> None:
        self.period = period
        self.crash_every = crash_every

    async def started(self) -> None:
        self.start_soon(self._tick)

    async def _tick(self) -> None:
        counter = current_registry().whereis("counter")
        n = 0
        while True:
            await anyio.sleep(self.period)
            n += 1
            if counter is not None and counter.is_running:
                counter.tell_nowait("tick")
            if self.crash_every and n % self.crash_every == 0 and random.random() < 0.5:
                raise RuntimeError("demo crash")


def demo_tree() -> list[ChildSpec]:
    """Children of the demo root: a counter and a rest_for_one group of tickers."""
    tickers = [ChildSpec(f"ticker-{i}", Ticker, backoff=Backoff(0.2, 2.0)) for i in range(2)]
    return [
        ChildSpec("counter", Counter, name="counter"),
        ChildSpec(
            "tickers",
            lambda: Supervisor(
                tickers,
                SupervisorFlags(Strategy.REST_FOR_ONE, intensity=10, period=10),
                name="tickers",
            ),
            kind="supervisor",
            restart=Restart.PERMANENT,
        ),
    ]
