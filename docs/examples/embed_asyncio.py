"""Embedding actorserve in a plain ``asyncio.run`` application.

The application keeps its own asyncio tasks; a supervision tree runs beside them inside
``open_supervisor``. The tasks talk to actors through refs, one actor crashes and is restarted by
its supervisor (the same ref keeps working), and leaving the block stops everything in order.

Run: ``python docs/examples/embed_asyncio.py``
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import structlog

from actors import Actor, ActorCrashed, ExitReason, WhileRestarting
from supervisors import ChildSpec, SupervisorFlags, open_supervisor

__all__ = ["Counter", "Flaky", "Greeter", "main"]


class Greeter(Actor):
    """Answers greetings, and streams a countdown."""

    async def receive(self, message: Any) -> Any:
        return f"hello, {message}"

    async def receive_stream(self, message: Any) -> AsyncIterator[Any]:
        for n in range(int(message), 0, -1):
            yield n


class Counter(Actor):
    """Counts what it is told; tells the total when asked."""

    def __init__(self) -> None:
        self.total = 0

    async def receive(self, message: Any) -> Any:
        if message == "total":
            return self.total
        self.total += int(message)
        return None


class Flaky(Actor):
    """Crashes on ``"boom"`` (a real exception: its supervisor restarts it)."""

    async def started(self) -> None:
        print("flaky: started", flush=True)

    async def stopping(self, reason: ExitReason) -> None:
        print(f"flaky: stopping ({reason.kind})", flush=True)

    async def receive(self, message: Any) -> Any:
        if message == "boom":
            raise RuntimeError("flaky went boom")
        return "fine"


CHILDREN = [
    ChildSpec("greeter", Greeter),
    ChildSpec("counter", Counter),
    # Calls made while it restarts wait (up to 5 s) for the new incarnation.
    ChildSpec("flaky", Flaky, while_restarting=WhileRestarting("wait", timeout=5.0)),
]


async def app_task(name: str, counter: Any, n: int) -> None:
    """One of the application's own asyncio tasks."""
    for _ in range(n):
        await counter.tell(1)
        await asyncio.sleep(0)
    print(f"{name}: told the counter {n} times", flush=True)


async def main() -> None:
    async with open_supervisor(CHILDREN, SupervisorFlags(intensity=3), name="app") as sup:
        greeter = await sup.child("greeter")
        counter = await sup.child("counter")
        flaky = await sup.child("flaky")
        print(f"children: {', '.join(c.id for c in await sup.which_children())}", flush=True)
        print(f"greeter: {await greeter.ask('asyncio')}", flush=True)
        async with greeter.stream(3) as countdown:
            print(f"countdown: {[n async for n in countdown]}", flush=True)

        # The application's own tasks, beside the tree.
        tasks = [asyncio.create_task(app_task(f"task-{i}", counter, 10)) for i in range(3)]
        await asyncio.gather(*tasks)
        print(f"counter: {await counter.ask('total')}", flush=True)

        try:
            await flaky.ask("boom")
        except ActorCrashed as exc:
            print(f"flaky crashed: {exc.reason}", flush=True)
        # Same ref, new incarnation: the supervisor restarted it.
        print(f"flaky after restart: {await flaky.ask('ping')}", flush=True)
        stats = flaky.statistics()
        print(f"flaky: incarnation {stats.incarnation}, restarts {stats.restarts}", flush=True)
    print("stopped cleanly", flush=True)


if __name__ == "__main__":
    # Only warnings from the supervisors (they log every child start at debug).
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    asyncio.run(main())
