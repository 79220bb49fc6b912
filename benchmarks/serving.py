"""The serving path's own cost: the whole path (HTTP -> frontend -> request-stream actor ->
engine process and back) against the engine called directly, mock engine in instant mode.

    python -m benchmarks.serving [--quick] [--mode aggregated|disaggregated]
                                 [--loop uvloop|asyncio|trio]

The root runs as its own process (``actorserve run``) so its CPU time can be read apart from the
client's; engines run in their own processes, as in production. Prints a table, then one JSON
line with ttft_overhead_ms_p50, ttft_overhead_ms_p99, chunk_overhead_us_p50, req_per_s_c1,
req_per_s_c32, req_per_s_c256, cpu_ms_per_req, engine_ttft_ms_p50, engine_process_ttft_ms_p50,
chunk_wakes, chunk_floor_us, chunk_overhead_us_c32, root_idle_cpu_ms_per_s.

- TTFT overhead: the served time to first token minus the engine's own (in-process) p50. The
  served TTFT is measured by a light client in a process of its own (the standard library's
  ``http.client``, see ``benchmarks._ttft_client``), one request at a time. Until 2026-11-22 it
  was the benchmark's in-process httpx client, which added 1-2.5 ms of its own per request (its
  event loop and h11's parsing, on the benchmark's CPU): figures before that date are not
  comparable. The load phases below still use httpx (they measure the root's CPU, not latency).
- engine_process_ttft_ms_p50: the engine in its own process, streamed straight from its process
  actor with no root in between: the share of the TTFT overhead that is the engine process and
  its link rather than the serving path (the rest is the root's, HTTP's and the client's).
- cpu_ms_per_req: the root process's CPU time (all its threads, from the scheduler's nanosecond
  counts since 2026-11-22, clock ticks of 10 ms before) per request of ``MAX_TOKENS`` tokens,
  the best of the three loads.
- chunk_overhead_us_p50: the root's CPU time per streamed chunk. Per round, the root's CPU per
  request is measured for requests of ``SHORT`` and of ``LONG`` tokens, one stream at a time;
  the difference over the difference in chunks received (``data:`` events) is what one more
  chunk costs, the fixed per-request work cancelled out; the figure is the median over the
  rounds. The root's idle CPU (heartbeats, health checks, server ticks; measured just before:
  ``root_idle_cpu_ms_per_s``) times the difference in duration is taken off: it grows with
  time, not chunks. ``chunk_overhead_us_c32``: the same with 32 streams at once, where one wake
  serves several streams' outputs (the cost that bounds a loaded root). CPU time, not
  gaps between chunks: a gap also holds the engine's time and the scheduler's noise, and the
  difference of two noisy gaps came out negative.
- chunk_wakes: the root's wake-ups per extra chunk (its threads' voluntary context switches),
  measured in the same rounds. The engine steps every ~1.9 ms there (``CHUNK_TIMING``), longer
  than the event loops' 1 ms timer resolution, so each output is its own wake and its own write,
  as in real decoding: about 1.0. (An engine far faster than the root lets outputs queue and go
  out together, which flatters the figure: until 2026-11-22 the steps were 0.57 ms, which the
  engine's virtual clock made into pairs of steps per 1 ms timer, about 0.5 wakes per chunk, so
  earlier figures are not comparable.)
- chunk_floor_us: the platform's part of a chunk, measured in the same run: an event loop with
  no serving code, woken by a message over a Unix socket every 1.9 ms, writing a chunk to a TCP
  client (``benchmarks._wake_floor``). The rest of ``chunk_overhead_us_p50`` is the serving
  path's own work.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from typing import IO, Any

import anyio
import httpx
import msgspec

from actors.lowlevel import default_loop, free_port
from actors.process import ProcessOptions
from actors.serving.cli import resolve_loop
from actors.serving.engines import MockEngine, MockEngineConfig, TimingModel
from actors.serving.root import wait_healthy
from benchmarks._common import percentile, report
from protocols import PreprocessedRequest, SamplingOptions, StopConditions
from supervisors import open_supervisor, process_child

PROMPT = "benchmark the serving path " * 4
MAX_TOKENS = 32
ENGINE_HOST = "actors.serving.worker._host:EngineHost"


# Per-chunk cost: an engine that decodes one token per ~1.9 ms step, longer than the event
# loops' 1 ms timers, so every output wakes the root and reaches the client as its own write.
CHUNK_TIMING = TimingModel(speedup=3.0)
CHUNK_STEP_S = CHUNK_TIMING.step_seconds(0, True, 0.0)
SHORT, LONG = 8, 128
LOADED = 32  # streams at once for the per-chunk cost under load


async def engine_direct(n: int, timing: TimingModel) -> list[float]:
    """TTFT of the engine alone (in-process)."""
    ttft = []
    async with MockEngine(_engine_config(timing)) as engine:
        for i in range(n):
            request = _request(f"direct-{i}")
            start = time.perf_counter()
            ttft.append(await _first_output_s(engine.generate(request), start))
    return ttft


def _engine_config(timing: TimingModel) -> MockEngineConfig:
    """An engine as the served root's (``start_root``), with nothing published."""
    return MockEngineConfig(
        timing=timing,
        kv_events_endpoint=None,
        kv_events_replay_endpoint=None,
        metrics_endpoint=None,
        num_blocks=8192,
        eos_token_id=257,
    )


def _request(rid: str) -> PreprocessedRequest:
    return PreprocessedRequest(
        rid=rid,
        token_ids=list(PROMPT.encode()),
        stop_conditions=StopConditions(max_tokens=MAX_TOKENS),
        sampling_options=SamplingOptions(temperature=0.0),
    )


async def _first_output_s(outputs: AsyncIterator[Any], start: float) -> float:
    """Seconds from ``start`` to the first of ``outputs``, read to the end."""
    first = -1.0
    async for _ in outputs:
        if first < 0:
            first = time.perf_counter() - start
    return first


async def engine_process(n: int, timing: TimingModel) -> list[float]:
    """TTFT of the engine in its own process, streamed straight from its process actor (the
    worker's engine host, on the root's loop), with no frontend, request stream or router."""
    config = _engine_config(timing)
    options = ProcessOptions(backend=default_loop())
    spec = process_child(
        "engine", ENGINE_HOST, "mock", msgspec.msgpack.encode(config), options=options
    )
    ttft = []
    async with open_supervisor([spec]) as sup:
        engine = await sup.child("engine")
        for i in range(n + 20):
            request = _request(f"process-{i}")
            start = time.perf_counter()
            async with engine.stream(request) as outputs:
                first = await _first_output_s(outputs, start)
            if i >= 20:
                ttft.append(first)
    return ttft


async def _one(client: httpx.AsyncClient, max_tokens: int = MAX_TOKENS) -> tuple[float, int]:
    """One streamed completion: its TTFT and how many chunks (``data:`` events) it had."""
    body = {
        "model": "mock",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    start = time.perf_counter()
    ttft = -1.0
    chunks = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if ttft < 0:
                ttft = time.perf_counter() - start
            chunks += 1
    return ttft, chunks


async def client_ttfts(port: int, count: int) -> list[float]:
    """TTFTs measured by a light client in its own process (see ``benchmarks._ttft_client``)."""
    args = [sys.executable, "-m", "benchmarks._ttft_client"]
    args += [str(port), str(count), "20", str(MAX_TOKENS), PROMPT]
    done = await anyio.run_process(args)
    ttfts: list[float] = msgspec.json.decode(done.stdout.splitlines()[-1])
    return ttfts


def _cpu(pid: int) -> float:
    """The CPU seconds of process ``pid``'s live threads, from the scheduler's nanosecond count
    (``/proc/<pid>/task/*/schedstat``): ``cpu_times`` counts in clock ticks of 10 ms, which made
    the per-chunk figure jump in steps of 17 us. A thread that ended meanwhile takes its time
    with it; the root's threads (ZMQ's I/O thread, anyio's workers) outlive a measurement."""
    return _per_thread(pid, "schedstat", lambda text: int(text.split()[0])) / 1e9


def _wakes(pid: int) -> int:
    """How often process ``pid``'s live threads went to sleep (voluntary context switches)."""
    field = "\nvoluntary_ctxt_switches:"  # not nonvoluntary_ctxt_switches
    return _per_thread(pid, "status", lambda text: int(text.split(field)[1].split()[0]))


def _per_thread(pid: int, name: str, value: Callable[[str], int]) -> int:
    """The sum of ``value`` over process ``pid``'s live threads' ``/proc`` file ``name``."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/{name}") as file:
                total += value(file.read())
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended just now
    return total


async def served(port: int, pid: int, quick: bool) -> dict[str, Any]:
    base_url = f"http://127.0.0.1:{port}"
    # Not used (plain HTTP), but made once: each client would load the CA bundle again.
    tls = ssl.create_default_context()
    ttfts = await client_ttfts(port, 100 if quick else 1000)
    rates = {}
    cpu_per_req = []
    for concurrency in (1, 32, 256):
        total = max(concurrency * (2 if quick else 8), 50 if quick else 400)
        done = 0
        # A client (one connection) per worker: httpx's pool scans every connection it holds
        # for each request, so one pool of 256 made the load generator, not the server, the
        # bottleneck at high concurrency (its CPU per request doubled from 32 to 256).
        clients = [
            httpx.AsyncClient(base_url=base_url, timeout=120, verify=tls)
            for _ in range(concurrency)
        ]
        cpu_before = _cpu(pid)
        start = time.perf_counter()

        async def worker(client: httpx.AsyncClient, count: int) -> None:
            nonlocal done
            for _ in range(count):
                await _one(client)
                done += 1

        async with anyio.create_task_group() as tg:
            per = total // concurrency
            for client in clients:
                tg.start_soon(worker, client, per)
        elapsed = time.perf_counter() - start
        rates[concurrency] = done / elapsed
        cpu_per_req.append((_cpu(pid) - cpu_before) / done)
        for client in clients:
            await client.aclose()
    return {"ttft": ttfts, "rates": rates, "cpu_per_req": cpu_per_req}


@contextlib.asynccontextmanager
async def running_root(
    mode: str, timing: TimingModel, loop: str | None
) -> AsyncIterator[tuple[int, int]]:
    """An ``actorserve run`` root, healthy: yields its port and pid. Its log is kept (warnings
    and up) and shown if it never becomes healthy."""
    port = free_port()
    with tempfile.TemporaryFile() as log:
        root = start_root(port, mode, timing, loop, log)
        try:
            try:
                await wait_healthy(port)
            except TimeoutError:
                log.seek(0)
                tail = log.read().decode(errors="replace")[-4000:]
                raise RuntimeError(f"the root never became healthy; its log:\n{tail}") from None
            yield port, root.pid
        finally:
            root.terminate()
            await anyio.to_thread.run_sync(root.wait, 60)


def start_root(
    port: int, mode: str, timing: TimingModel, loop: str | None, log: IO[bytes]
) -> subprocess.Popen[bytes]:
    timing_arg = f"timing={msgspec.json.encode(timing).decode()}"
    args = [
        sys.executable,
        "-m",
        "actors.serving",
        "run",
        "--backend",
        "mock",
        "--mode",
        mode,
        "--prefill-workers",
        "1",
        "--decode-workers",
        "2",
        "--port",
        str(port),
        "--served-model-name",
        "mock",
        "--engine-arg",
        timing_arg,
        "--engine-arg",
        "num_blocks=8192",
        "--engine-arg",
        "eos_token_id=257",
        "--control",
        f"/tmp/actorserve-bench-{os.getpid()}.ctl",
        # None: actorserve run's own default, so the figures describe the product.
        *(["--loop", loop] if loop else []),
    ]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log)


async def chunk_costs(port: int, pid: int, rounds: int, per_round: int) -> dict[str, Any]:
    """Per round: the root's CPU seconds and wake-ups per chunk, from requests of SHORT and LONG
    tokens, one stream at a time and then ``LOADED`` at once; and the root's idle CPU (seconds
    per second)."""
    base_url = f"http://127.0.0.1:{port}"
    clients = [httpx.AsyncClient(base_url=base_url, timeout=120) for _ in range(LOADED)]
    try:
        for _ in range(3):
            await _one(clients[0], LONG)
        start, before = time.perf_counter(), _cpu(pid)
        await anyio.sleep(2.0)
        idle = (_cpu(pid) - before) / (time.perf_counter() - start)
        costs: dict[int, list[float]] = {1: [], LOADED: []}
        wakes: list[float] = []
        for _ in range(rounds):
            for streams, count in ((1, per_round), (LOADED, max(1, per_round // 4))):
                cpu: dict[int, float] = {}
                woke: dict[int, int] = {}
                chunks: dict[int, int] = {}
                for tokens in (SHORT, LONG):
                    start, before, woke_before = time.perf_counter(), _cpu(pid), _wakes(pid)
                    chunks[tokens] = await _streams(clients[:streams], count, tokens)
                    elapsed = time.perf_counter() - start
                    cpu[tokens] = _cpu(pid) - before - idle * elapsed
                    woke[tokens] = _wakes(pid) - woke_before
                more = chunks[LONG] - chunks[SHORT]
                costs[streams].append((cpu[LONG] - cpu[SHORT]) / more)
                if streams == 1:
                    wakes.append((woke[LONG] - woke[SHORT]) / more)
    finally:
        for client in clients:
            await client.aclose()
    return {"chunk": costs[1], "chunk_loaded": costs[LOADED], "wakes": wakes, "idle": idle}


async def _streams(clients: list[httpx.AsyncClient], count: int, tokens: int) -> int:
    """``count`` streamed requests of ``tokens`` tokens on each client at once: the chunks."""
    chunks: list[int] = []

    async def run(client: httpx.AsyncClient) -> None:
        chunks.extend([(await _one(client, tokens))[1] for _ in range(count)])

    async with anyio.create_task_group() as tg:
        for client in clients:
            tg.start_soon(run, client)
    return sum(chunks)


async def wake_floor(count: int) -> float:
    """CPU seconds per chunk of an event loop with no serving code (``benchmarks._wake_floor``),
    paced as the engine's steps."""
    args = [sys.executable, "-m", "benchmarks._wake_floor", str(CHUNK_STEP_S), str(count)]
    done = await anyio.run_process(args)
    per_wake: float = msgspec.json.decode(done.stdout.splitlines()[-1])
    return per_wake


async def main_async(quick: bool, mode: str, loop: str | None) -> dict[str, Any]:
    n = 100 if quick else 1000
    direct_ttft = await engine_direct(n, TimingModel(instant=True))
    process_ttft = await engine_process(n, TimingModel(instant=True))
    async with running_root(mode, TimingModel(instant=True), loop) as (port, pid):
        result = await served(port, pid, quick)
    async with running_root(mode, CHUNK_TIMING, loop) as (port, pid):
        result.update(await chunk_costs(port, pid, 5 if quick else 20, 5 if quick else 10))
    floor = await wake_floor(500 if quick else 2000)
    ttft_over = [t - percentile(direct_ttft, 50) for t in result["ttft"]]
    return {
        "ttft_overhead_ms_p50": round(percentile(ttft_over, 50) * 1e3, 3),
        "ttft_overhead_ms_p99": round(percentile(ttft_over, 99) * 1e3, 3),
        "chunk_overhead_us_p50": round(percentile(result["chunk"], 50) * 1e6, 1),
        "chunk_wakes": round(percentile(result["wakes"], 50), 2),
        "chunk_overhead_us_c32": round(percentile(result["chunk_loaded"], 50) * 1e6, 1),
        "chunk_floor_us": round(floor * 1e6, 1),
        "root_idle_cpu_ms_per_s": round(result["idle"] * 1e3, 2),
        "req_per_s_c1": round(result["rates"][1], 1),
        "req_per_s_c32": round(result["rates"][32], 1),
        "req_per_s_c256": round(result["rates"][256], 1),
        "cpu_ms_per_req": round(min(result["cpu_per_req"]) * 1e3, 3),
        "engine_ttft_ms_p50": round(percentile(direct_ttft, 50) * 1e3, 3),
        "engine_process_ttft_ms_p50": round(percentile(process_ttft, 50) * 1e3, 3),
        "mode": mode,
        "loop": resolve_loop(loop),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (under 60 s)")
    parser.add_argument("--mode", default="aggregated", choices=["aggregated", "disaggregated"])
    parser.add_argument(
        "--loop",
        choices=["uvloop", "asyncio", "trio"],
        help="the root's event loop (default: actorserve run's own)",
    )
    args = parser.parse_args()
    r = anyio.run(main_async, args.quick, args.mode, args.loop)
    rows = [
        ("TTFT overhead p50 (ms)", r["ttft_overhead_ms_p50"], "goal <= 1; over the engine alone"),
        ("TTFT overhead p99 (ms)", r["ttft_overhead_ms_p99"], ""),
        (
            "per-chunk overhead p50 (us)",
            r["chunk_overhead_us_p50"],
            f"goal <= 50; root CPU per chunk ({LONG} vs {SHORT} tokens), its idle CPU off",
        ),
        ("  root wake-ups per chunk", r["chunk_wakes"], "1: each output its own wake and write"),
        (
            "  platform floor per chunk (us)",
            r["chunk_floor_us"],
            "a bare event loop woken per chunk, writing it to TCP",
        ),
        (
            f"per-chunk overhead, {LOADED} streams (us)",
            r["chunk_overhead_us_c32"],
            "p50; one wake serves several streams' outputs",
        ),
        ("root idle CPU (ms/s)", r["root_idle_cpu_ms_per_s"], "heartbeats, health checks, ticks"),
        ("requests/s, concurrency 1", r["req_per_s_c1"], f"{MAX_TOKENS} tokens each"),
        ("requests/s, concurrency 32", r["req_per_s_c32"], ""),
        ("requests/s, concurrency 256", r["req_per_s_c256"], ""),
        ("root CPU per request (ms)", r["cpu_ms_per_req"], "goal <= 1; best of the three loads"),
        ("engine alone TTFT p50 (ms)", r["engine_ttft_ms_p50"], "in-process, instant mode"),
        (
            "engine in its process TTFT p50 (ms)",
            r["engine_process_ttft_ms_p50"],
            "through its process actor, no root",
        ),
    ]
    title = f"serving path ({r['mode']}, root on {r['loop']}, mock engines in child processes)"
    report(title, rows, r)


if __name__ == "__main__":
    main()
