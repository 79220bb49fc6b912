"""Embedding actorserve in a ``trio.run`` application.

The same tree as ``embed_asyncio.py`` beside it, inside a trio program whose own tasks run
in its own nursery: messages, a stream, a crash and its restart, then an orderly shutdown.

Run: ``python docs/examples/embed_trio.py``
"""

from __future__ import annotations

import logging
from typing import Any

import structlog
import trio
import trio.lowlevel
from embed_asyncio import CHILDREN  # the script's own folder is on sys.path

from actors import ActorCrashed
from supervisors import SupervisorFlags, open_supervisor

__all__ = ["main"]


async def app_task(name: str, counter: Any, n: int) -> None:
    """One of the application's own trio tasks."""
    for _ in range(n):
        await counter.tell(1)
        await trio.lowlevel.checkpoint()
    print(f"{name}: told the counter {n} times", flush=True)


async def main() -> None:
    async with open_supervisor(CHILDREN, SupervisorFlags(intensity=3), name="app") as sup:
        greeter = await sup.child("greeter")
        counter = await sup.child("counter")
        flaky = await sup.child("flaky")
        print(f"children: {', '.join(c.id for c in await sup.which_children())}", flush=True)
        print(f"greeter: {await greeter.ask('trio')}", flush=True)
        async with greeter.stream(3) as countdown:
            print(f"countdown: {[n async for n in countdown]}", flush=True)

        # The application's own tasks, in its own nursery.
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(app_task, f"task-{i}", counter, 10)
        print(f"counter: {await counter.ask('total')}", flush=True)

        try:
            await flaky.ask("boom")
        except ActorCrashed as exc:
            print(f"flaky crashed: {exc.reason}", flush=True)
        print(f"flaky after restart: {await flaky.ask('ping')}", flush=True)
        stats = flaky.statistics()
        print(f"flaky: incarnation {stats.incarnation}, restarts {stats.restarts}", flush=True)
    print("stopped cleanly", flush=True)


if __name__ == "__main__":
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    trio.run(main)
