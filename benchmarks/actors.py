"""Actor core and supervisor costs on asyncio and trio, against anyio/asyncio baselines.

    python -m benchmarks.actors [--quick]   (as a script, this file would shadow the actors package)

Prints a table, then one JSON line with ask_rtt_us_p50_{asyncio,trio},
tell_msgs_per_s_{asyncio,trio}, restart_us_p50_{asyncio,trio},
dynamic_start_ask_us_p50_{asyncio,trio}, spawn_10k_actors_s and the
baselines baseline_asyncio_queue_msgs_per_s, baseline_anyio_stream_rtt_us_p50.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel

from actors import Actor, ActorCrashed, ActorRef
from benchmarks._common import percentile, report
from supervisors import ChildSpec, Restart, Strategy, SupervisorFlags, open_supervisor


class Echo(Actor):
    def __init__(self) -> None:
        self.count = 0

    async def receive(self, message: Any) -> Any:
        if message == "crash":
            raise RuntimeError("benchmark crash")
        self.count += 1
        return message


class Idle(Actor):
    pass


class OneShot(Actor):
    """A request stream's shape: started with its first message, answers it, and ends."""

    async def receive(self, message: Any) -> Any:
        self.stop()
        return message


async def _p50_us(
    call: Callable[[], Awaitable[Any]],
    n: int,
    between: Callable[[], Awaitable[None]] | None = None,
) -> float:
    """The p50 of ``n`` timed awaits of ``call()`` in microseconds, after a warm-up; ``between``
    (untimed) runs after each."""
    for _ in range(min(n, 1000)):
        await call()
    samples = []
    clock = time.perf_counter
    for _ in range(n):
        start = clock()
        await call()
        samples.append(clock() - start)
        if between is not None:
            await between()
    return percentile(samples, 50) * 1e6


async def _ask_rtt(ref: ActorRef[Any], n: int) -> float:
    return await _p50_us(functools.partial(ref.ask, 1), n)


async def _tell_rate(ref: ActorRef[Any], n: int) -> float:
    start = time.perf_counter()
    tell = ref.tell
    for _ in range(n):
        await tell(1)
    await ref.ask("sync", timeout=None)
    return n / (time.perf_counter() - start)


async def _restart_us(ref: ActorRef[Any], n: int) -> float:
    samples = []
    for _ in range(n):
        before = ref.statistics().incarnation
        start = time.perf_counter()
        try:
            await ref.ask("crash")
        except ActorCrashed:
            pass
        while not (ref.is_running and ref.statistics().incarnation > before):
            await anyio.lowlevel.checkpoint()
        samples.append(time.perf_counter() - start)
    return percentile(samples, 50) * 1e6


async def _core(quick: bool) -> dict[str, float]:
    n_ask = 5_000 if quick else 50_000
    n_tell = 200_000 if quick else 2_000_000
    n_restart = 200 if quick else 2_000
    flags = SupervisorFlags(intensity=10**9, period=1)
    async with open_supervisor([ChildSpec("echo", Echo)], flags) as sup:
        ref = await sup.child("echo")
        rtt = await _ask_rtt(ref, n_ask)
        rate = await _tell_rate(ref, n_tell)
        restart = await _restart_us(ref, n_restart)
    return {"ask_rtt_us_p50": rtt, "tell_msgs_per_s": rate, "restart_us_p50": restart}


async def _spawn(n: int) -> float:
    template = ChildSpec("idle", Idle, restart=Restart.TEMPORARY)
    async with open_supervisor([template], SupervisorFlags(Strategy.SIMPLE_ONE_FOR_ONE)) as sup:
        start = time.perf_counter()
        for _ in range(n):
            await sup.start_dynamic()
        elapsed = time.perf_counter() - start
    return elapsed


async def _start_ask_us(n: int) -> float:
    """``start_dynamic_ask`` round trip: a temporary child started with the message in its
    mailbox, until its reply (the serving path's start of a request stream)."""
    template = ChildSpec("oneshot", OneShot, restart=Restart.TEMPORARY, shutdown=5.0)
    flags = SupervisorFlags(Strategy.SIMPLE_ONE_FOR_ONE, intensity=10**9, period=1)
    async with open_supervisor([template], flags) as sup:
        # Between two starts, a checkpoint: the child's exit, as between requests.
        call = functools.partial(sup.start_dynamic_ask, 1)
        return await _p50_us(call, n, anyio.lowlevel.checkpoint)


async def _baseline_queue(n: int) -> float:
    queue: asyncio.Queue[int] = asyncio.Queue(65536)
    done = asyncio.Event()

    async def consume() -> None:
        for _ in range(n):
            await queue.get()
        done.set()

    task = asyncio.ensure_future(consume())
    start = time.perf_counter()
    for i in range(n):
        await queue.put(i)
    await done.wait()
    await task
    return n / (time.perf_counter() - start)


async def _baseline_stream_rtt(n: int) -> float:
    send_req, recv_req = anyio.create_memory_object_stream[int](0)
    send_rep, recv_rep = anyio.create_memory_object_stream[int](0)

    async def server() -> None:
        async with recv_req, send_rep:
            async for item in recv_req:
                await send_rep.send(item)

    samples = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(server)
        async with send_req, recv_rep:
            for i in range(n):
                start = time.perf_counter()
                await send_req.send(i)
                await recv_rep.receive()
                samples.append(time.perf_counter() - start)
    return percentile(samples, 50) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (under 30 s)")
    args = parser.parse_args()
    quick = args.quick
    results: dict[str, Any] = {}
    for backend in ("asyncio", "trio"):
        core = anyio.run(_core, quick, backend=backend)
        for key, value in core.items():
            results[f"{key}_{backend}"] = round(value, 2)
        start_ask = anyio.run(_start_ask_us, 2_000 if quick else 20_000, backend=backend)
        results[f"dynamic_start_ask_us_p50_{backend}"] = round(start_ask, 2)
    results["spawn_10k_actors_s"] = round(anyio.run(_spawn, 10_000), 3)
    n_base = 200_000 if quick else 1_000_000
    results["baseline_asyncio_queue_msgs_per_s"] = round(anyio.run(_baseline_queue, n_base), 0)
    results["baseline_anyio_stream_rtt_us_p50"] = round(
        anyio.run(_baseline_stream_rtt, 5_000 if quick else 50_000), 2
    )
    rows = [
        ("ask round trip p50, asyncio (us)", results["ask_rtt_us_p50_asyncio"], "goal <= 10"),
        ("ask round trip p50, trio (us)", results["ask_rtt_us_p50_trio"], "goal <= 20"),
        ("tell, asyncio (msgs/s)", results["tell_msgs_per_s_asyncio"], "goal >= 1M"),
        ("tell, trio (msgs/s)", results["tell_msgs_per_s_trio"], ""),
        (
            "restart p50, asyncio (us)",
            results["restart_us_p50_asyncio"],
            "crash -> new incarnation ready",
        ),
        ("restart p50, trio (us)", results["restart_us_p50_trio"], ""),
        (
            "start_dynamic_ask p50, asyncio (us)",
            results["dynamic_start_ask_us_p50_asyncio"],
            "temporary child started with an ask, to its reply",
        ),
        ("start_dynamic_ask p50, trio (us)", results["dynamic_start_ask_us_p50_trio"], ""),
        (
            "spawn 10k dynamic actors (s)",
            results["spawn_10k_actors_s"],
            "asyncio, sequential start_child",
        ),
        (
            "baseline asyncio.Queue (msgs/s)",
            results["baseline_asyncio_queue_msgs_per_s"],
            "same run",
        ),
        (
            "baseline anyio stream RTT p50 (us)",
            results["baseline_anyio_stream_rtt_us_p50"],
            "two memory streams",
        ),
    ]
    report("actors", rows, results)


if __name__ == "__main__":
    main()
