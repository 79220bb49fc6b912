"""Process actors: round trip, stream throughput, death detection and restart, against raw pyzmq.

    python -m benchmarks.process [--quick] [--backend trio]

Prints a table, then one JSON line with proc_ask_rtt_us_p50, proc_ask_rtt_us_p99,
proc_stream_chunks_per_s (a chunk = 16 token ids), kill_detect_ms_p50, proc_restart_ms_p50
(trivial init), baseline_zmq_rtt_us_p50 (blocking REQ/REP between two processes, same run) and
baseline_zmq_loop_rtt_us_p50: raw pyzmq DEALER/ROUTER driven by the benchmark's event loop on both
sides (the FD waited on by the loop, EVENTS re-checked after each send), the floor for any
event-loop design over ZMQ on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from typing import Any

import anyio
import sniffio
import zmq

from actors import ActorCrashed, ActorRef
from actors.process import ProcessOptions
from benchmarks._common import percentile, report
from supervisors import SupervisorFlags, open_supervisor, process_child

ECHO = "tests.process.workers:Echo"
_ECHO_SERVER = """
import sys, zmq
sock = zmq.Context().socket(zmq.REP)
sock.connect(sys.argv[1])
while True:
    msg = sock.recv()
    sock.send(msg)
    if msg == b"stop":
        break
"""


_LOOP_ECHO_SERVER = """
import sys, zmq
sock = zmq.Context().socket(zmq.ROUTER)
sock.connect(sys.argv[1])
fd = sock.getsockopt(zmq.FD)

def drain():  # echo what is queued (EVENTS also re-arms the FD); False after "stop"
    while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
        frames = sock.recv_multipart(zmq.NOBLOCK)
        sock.send_multipart(frames, zmq.NOBLOCK)
        if frames[-1] == b"stop":
            return False
    return True

if sys.argv[2] == "trio":
    import trio

    async def main():
        while drain():
            await trio.lowlevel.wait_readable(fd)

    trio.run(main)
else:
    import asyncio

    async def main():
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def on_readable():
            if not drain() and not done.done():
                done.set_result(None)

        loop.add_reader(fd, on_readable)
        on_readable()
        await done

    asyncio.run(main())
"""


async def baseline_zmq_loop_rtt(n: int) -> float:
    """Raw DEALER/ROUTER round trips with the running event loop waiting on ZMQ's FD."""
    endpoint = f"ipc:///tmp/actorserve-bench-loop-{os.getpid()}.sock"
    library = sniffio.current_async_library()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.bind(endpoint)
    server = await anyio.open_process([sys.executable, "-c", _LOOP_ECHO_SERVER, endpoint, library])
    fd = int(sock.getsockopt(zmq.FD))
    loop = asyncio.get_running_loop() if library == "asyncio" else None
    waiter: asyncio.Future[None] | None = None

    def on_readable() -> None:
        if waiter is not None and not waiter.done() and _has_input(sock):
            waiter.set_result(None)

    async def wait_input() -> None:
        nonlocal waiter
        while not _has_input(sock):
            if loop is None:
                import trio

                await trio.lowlevel.wait_readable(fd)
            else:
                waiter = loop.create_future()
                await waiter

    async def round_trip(payload: bytes) -> None:
        sock.send(payload, zmq.NOBLOCK)
        await wait_input()
        sock.recv(zmq.NOBLOCK)

    if loop is not None:
        loop.add_reader(fd, on_readable)
    try:
        sock.send(b"x")  # blocking: waits for the connection
        await wait_input()
        sock.recv()
        for _ in range(200):
            await round_trip(b"x")
        samples = []
        for _ in range(n):
            start = time.perf_counter()
            await round_trip(b"x")
            samples.append(time.perf_counter() - start)
        await round_trip(b"stop")
    finally:
        if loop is not None:
            loop.remove_reader(fd)
        with anyio.fail_after(5):
            await server.wait()
        await server.aclose()
        sock.close(0)
        ctx.term()
    return percentile(samples, 50) * 1e6


def _has_input(sock: zmq.Socket[bytes]) -> bool:
    return bool(int(sock.getsockopt(zmq.EVENTS)) & int(zmq.POLLIN))


def baseline_zmq_rtt(n: int) -> float:
    endpoint = f"ipc:///tmp/actorserve-bench-{os.getpid()}.sock"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.bind(endpoint)
    server = subprocess.Popen([sys.executable, "-c", _ECHO_SERVER, endpoint])
    try:
        for _ in range(200):
            sock.send(b"x")
            sock.recv()
        samples = []
        for _ in range(n):
            start = time.perf_counter()
            sock.send(b"x")
            sock.recv()
            samples.append(time.perf_counter() - start)
        sock.send(b"stop")
        sock.recv()
    finally:
        server.wait(5)
        sock.close(0)
        ctx.term()
    return percentile(samples, 50) * 1e6


async def _kill_and_restart(ref: ActorRef[Any]) -> tuple[float, float]:
    """Seconds from SIGKILL to a pending ask failing, and to the new incarnation answering."""
    incarnation = ref.statistics().incarnation
    pid = await ref.ask("pid")
    failed = anyio.Event()
    times: dict[str, float] = {}

    async def pending() -> None:
        try:
            await ref.ask(("sleep", 30), timeout=None)
        except ActorCrashed:
            times["detected"] = time.perf_counter()
            failed.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(pending)
        await anyio.sleep(0.02)
        killed_at = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        await failed.wait()
        await ref.wait_running(after=incarnation)
        await ref.ask(1)
        answered = time.perf_counter()
    return times["detected"] - killed_at, answered - killed_at


async def measure(quick: bool) -> dict[str, float]:
    n_ask = 3_000 if quick else 30_000
    n_chunks = 100_000 if quick else 1_000_000
    n_kill = 10 if quick else 50
    options = ProcessOptions(heartbeat_interval=0.5, heartbeat_timeout=10.0)
    flags = SupervisorFlags(intensity=10**6, period=1)
    async with open_supervisor([process_child("echo", ECHO, options=options)], flags) as sup:
        ref = await sup.child("echo")
        for _ in range(500):
            await ref.ask(1)
        samples = []
        for _ in range(n_ask):
            start = time.perf_counter()
            await ref.ask(1)
            samples.append(time.perf_counter() - start)
        start = time.perf_counter()
        count = 0
        async with ref.stream(("chunks", n_chunks, 16), buffer=256) as chunks:
            async for _ in chunks:
                count += 1
        chunks_per_s = count / (time.perf_counter() - start)
        detect, restart = [], []
        for _ in range(n_kill):
            took = await _kill_and_restart(ref)
            detect.append(took[0])
            restart.append(took[1])
    loop_floor = await baseline_zmq_loop_rtt(n_ask)
    return {
        "proc_ask_rtt_us_p50": percentile(samples, 50) * 1e6,
        "proc_ask_rtt_us_p99": percentile(samples, 99) * 1e6,
        "proc_stream_chunks_per_s": chunks_per_s,
        "kill_detect_ms_p50": percentile(detect, 50) * 1e3,
        "proc_restart_ms_p50": percentile(restart, 50) * 1e3,
        "baseline_zmq_loop_rtt_us_p50": loop_floor,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (under 30 s)")
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    args = parser.parse_args()
    results = {
        k: round(v, 2) for k, v in anyio.run(measure, args.quick, backend=args.backend).items()
    }
    results["baseline_zmq_rtt_us_p50"] = round(baseline_zmq_rtt(3_000 if args.quick else 30_000), 2)
    ratio = results["proc_ask_rtt_us_p50"] / results["baseline_zmq_rtt_us_p50"]
    loop_ratio = results["proc_ask_rtt_us_p50"] / results["baseline_zmq_loop_rtt_us_p50"]
    rows = [
        (
            "ask round trip p50 (us)",
            results["proc_ask_rtt_us_p50"],
            f"goal <= 50; {ratio:.2f}x raw zmq, {loop_ratio:.2f}x raw zmq in an event loop",
        ),
        ("ask round trip p99 (us)", results["proc_ask_rtt_us_p99"], ""),
        ("stream chunks/s (16 ids each)", results["proc_stream_chunks_per_s"], "goal >= 200k"),
        (
            "SIGKILL -> pending ask fails p50 (ms)",
            results["kill_detect_ms_p50"],
            "goal <= 5 (pidfd)",
        ),
        (
            "SIGKILL -> restarted and answering p50 (ms)",
            results["proc_restart_ms_p50"],
            "goal <= 300",
        ),
        ("baseline raw zmq REQ/REP p50 (us)", results["baseline_zmq_rtt_us_p50"], "same run"),
        (
            f"baseline raw zmq DEALER/ROUTER in {args.backend} p50 (us)",
            results["baseline_zmq_loop_rtt_us_p50"],
            "same run: the floor for an event loop",
        ),
    ]
    report(f"process actors ({args.backend})", rows, results)


if __name__ == "__main__":
    main()
