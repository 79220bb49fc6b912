"""Process actors: round trip, stream throughput, death detection and restart, against raw sockets.

    python -m benchmarks.process [--quick] [--backend trio] [--child-backend trio|uvloop]

Prints a table, then one JSON line. For the default transport (unix: a Unix-domain stream
socket): proc_ask_rtt_us_p50, proc_ask_rtt_us_p99, proc_stream_chunks_per_s (a chunk = 16 token
ids), kill_detect_ms_p50, proc_restart_ms_p50 (trivial init); the same round trip and stream over
ZMQ ipc under the ``_zmq`` suffix. Baselines from the same run: baseline_zmq_rtt_us_p50 (blocking
REQ/REP between two processes), baseline_zmq_loop_rtt_us_p50 (raw pyzmq DEALER/ROUTER driven by the
benchmark's event loop on both sides, the FD waited on by the loop, EVENTS re-checked after each
send: the floor for any event-loop design over ZMQ) and baseline_unix_loop_rtt_us_p50 (a raw Unix
stream socket driven by the event loop on both sides: the floor for the unix link).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import anyio
import sniffio
import zmq

from actors import ActorCrashed, ActorRef
from actors.process import ProcessOptions, Transport
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

# An echo server driven by an event loop: a transport's part (sock, fd, drain) then the loop's.
_ZMQ_PART = """
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
"""
_UNIX_PART = """
import socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(sys.argv[1])
sock.setblocking(False)
fd = sock.fileno()

def drain():  # echo what is queued; False after "stop"
    try:
        data = sock.recv(65536)
    except BlockingIOError:
        return True
    sock.send(data)
    return bool(data) and not data.endswith(b"stop")
"""
_LOOP_PART = """
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


async def _loop_round_trips(
    n: int,
    fd: int,
    send: Callable[[bytes], Any],
    ready: Callable[[], bool],
    take: Callable[[], Any],
) -> float:
    """p50 of ``n`` round trips (us) with the running event loop waiting on ``fd``: ``ready``
    tells a reply is there (it may read it), ``take`` takes it; the last message is ``stop``."""
    loop = asyncio.get_running_loop() if sniffio.current_async_library() == "asyncio" else None
    waiter: asyncio.Future[None] | None = None

    def on_readable() -> None:
        if waiter is not None and not waiter.done() and ready():
            waiter.set_result(None)

    async def round_trip(payload: bytes) -> None:
        nonlocal waiter
        send(payload)
        while not ready():
            if loop is None:
                import trio

                await trio.lowlevel.wait_readable(fd)
            else:
                waiter = loop.create_future()
                await waiter
        take()

    if loop is not None:
        loop.add_reader(fd, on_readable)
    try:
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
    return percentile(samples, 50) * 1e6


async def baseline_zmq_loop_rtt(n: int) -> float:
    """Raw DEALER/ROUTER round trips with the running event loop waiting on ZMQ's FD."""
    endpoint = f"ipc:///tmp/actorserve-bench-loop-{os.getpid()}.sock"
    library = sniffio.current_async_library()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.bind(endpoint)
    server = await anyio.open_process(
        [sys.executable, "-c", _ZMQ_PART + _LOOP_PART, endpoint, library]
    )
    try:
        sock.send(b"x")  # blocking: waits for the connection
        sock.recv()
        return await _loop_round_trips(
            n,
            int(sock.getsockopt(zmq.FD)),
            lambda m: sock.send(m, zmq.NOBLOCK),
            lambda: _has_input(sock),
            lambda: sock.recv(zmq.NOBLOCK),
        )
    finally:
        with anyio.fail_after(5):
            await server.wait()
        await server.aclose()
        sock.close(0)
        ctx.term()


def _has_input(sock: zmq.Socket[bytes]) -> bool:
    return bool(int(sock.getsockopt(zmq.EVENTS)) & int(zmq.POLLIN))


async def baseline_unix_loop_rtt(n: int) -> float:
    """Raw round trips over a Unix stream socket, the running event loop waiting on its FD."""
    directory = tempfile.mkdtemp(prefix="actorserve-bench-")
    path = os.path.join(directory, "echo.sock")
    library = sniffio.current_async_library()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(1)
        server = await anyio.open_process(
            [sys.executable, "-c", _UNIX_PART + _LOOP_PART, path, library]
        )
        listener.settimeout(10)
        sock, _ = listener.accept()
    os.unlink(path)
    os.rmdir(directory)
    sock.setblocking(False)
    got = bytearray(65536)
    received = False

    def ready() -> bool:  # reads the reply if it is there
        nonlocal received
        if not received:
            try:
                received = sock.recv_into(got) > 0
            except BlockingIOError:
                pass
        return received

    def take() -> None:
        nonlocal received
        received = False

    try:
        return await _loop_round_trips(n, sock.fileno(), sock.send, ready, take)
    finally:
        with anyio.fail_after(5):
            await server.wait()
        await server.aclose()
        sock.close()


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


async def _round_trips_and_stream(ref: ActorRef[Any], quick: bool) -> tuple[list[float], float]:
    """Ask round trips (seconds each), then stream chunks per second."""
    n_ask = 3_000 if quick else 30_000
    n_chunks = 100_000 if quick else 1_000_000
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
    return samples, count / (time.perf_counter() - start)


async def measure(quick: bool, child_backend: str) -> dict[str, float]:
    n_ask = 3_000 if quick else 30_000
    n_kill = 10 if quick else 50
    flags = SupervisorFlags(intensity=10**6, period=1)
    results: dict[str, float] = {}
    transports: list[tuple[Transport, str]] = [("unix", ""), ("ipc", "_zmq")]
    for transport, suffix in transports:
        options = ProcessOptions(
            transport=transport,
            backend=child_backend,  # type: ignore[arg-type]  # one of argparse's choices
            heartbeat_interval=0.5,
            heartbeat_timeout=10.0,
        )
        async with open_supervisor([process_child("echo", ECHO, options=options)], flags) as sup:
            ref = await sup.child("echo")
            samples, chunks_per_s = await _round_trips_and_stream(ref, quick)
            results[f"proc_ask_rtt_us_p50{suffix}"] = percentile(samples, 50) * 1e6
            results[f"proc_ask_rtt_us_p99{suffix}"] = percentile(samples, 99) * 1e6
            results[f"proc_stream_chunks_per_s{suffix}"] = chunks_per_s
            if transport == "unix":
                detect, restart = [], []
                for _ in range(n_kill):
                    took = await _kill_and_restart(ref)
                    detect.append(took[0])
                    restart.append(took[1])
                results["kill_detect_ms_p50"] = percentile(detect, 50) * 1e3
                results["proc_restart_ms_p50"] = percentile(restart, 50) * 1e3
    results["baseline_zmq_loop_rtt_us_p50"] = await baseline_zmq_loop_rtt(n_ask)
    results["baseline_unix_loop_rtt_us_p50"] = await baseline_unix_loop_rtt(n_ask)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (under 30 s)")
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    parser.add_argument(
        "--child-backend",
        default="asyncio",
        choices=["asyncio", "trio", "uvloop"],
        help="the actor process's event loop (the default ProcessOptions: asyncio; uvloop: "
        "asyncio on uvloop's loop, the uvloop extra)",
    )
    args = parser.parse_args()
    measured = anyio.run(measure, args.quick, args.child_backend, backend=args.backend)
    results = {k: round(v, 2) for k, v in measured.items()}
    results["baseline_zmq_rtt_us_p50"] = round(baseline_zmq_rtt(3_000 if args.quick else 30_000), 2)
    ask = results["proc_ask_rtt_us_p50"]
    ratio = ask / results["baseline_zmq_rtt_us_p50"]
    unix_ratio = ask / results["baseline_unix_loop_rtt_us_p50"]
    loop = f"{args.backend}/{args.child_backend}"
    rows = [
        (
            "ask round trip p50 (us), unix",
            ask,
            f"goal <= 50; {ratio:.2f}x raw zmq REQ/REP, {unix_ratio:.2f}x raw unix in a loop",
        ),
        ("ask round trip p99 (us), unix", results["proc_ask_rtt_us_p99"], ""),
        (
            "stream chunks/s (16 ids each), unix",
            results["proc_stream_chunks_per_s"],
            "goal >= 200k",
        ),
        (
            "ask round trip p50 (us), zmq ipc",
            results["proc_ask_rtt_us_p50_zmq"],
            f"{results['proc_ask_rtt_us_p50_zmq'] / results['baseline_zmq_loop_rtt_us_p50']:.2f}x"
            " raw zmq in a loop",
        ),
        ("ask round trip p99 (us), zmq ipc", results["proc_ask_rtt_us_p99_zmq"], ""),
        ("stream chunks/s, zmq ipc", results["proc_stream_chunks_per_s_zmq"], ""),
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
            "same run: the floor for an event loop over zmq",
        ),
        (
            f"baseline raw unix socket in {args.backend} p50 (us)",
            results["baseline_unix_loop_rtt_us_p50"],
            "same run: the floor for the unix link",
        ),
    ]
    report(f"process actors ({loop})", rows, results)


if __name__ == "__main__":
    main()
