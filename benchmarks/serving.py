"""The serving path's own cost: the whole path (HTTP -> frontend -> request-stream actor ->
engine process and back) against the engine called directly, mock engine in instant mode.

    python benchmarks/serving.py [--quick] [--mode aggregated|disaggregated]

The root runs as its own process (``actorserve run``) so its CPU time can be read apart from the
client's; engines run in their own processes, as in production. Prints a table, then one JSON
line with ttft_overhead_ms_p50, ttft_overhead_ms_p99, chunk_overhead_us_p50, req_per_s_c1,
req_per_s_c32, req_per_s_c256, cpu_ms_per_req.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Any

import anyio
import httpx
import msgspec
import psutil

from actors._net import free_port
from actors.engines import MockEngine, MockEngineConfig, TimingModel
from benchmarks._common import percentile, report
from protocols import PreprocessedRequest, SamplingOptions, StopConditions
from supervisors._root import wait_healthy

PROMPT = "benchmark the serving path " * 4
MAX_TOKENS = 32


# Chunk timing uses a steady engine (one token per ~60 us step) so that every step is one output
# on both paths: the served gap minus the engine's own gap is what the path adds per chunk.
STEADY = TimingModel(speedup=100.0)


async def engine_direct(n: int, timing: TimingModel) -> tuple[list[float], list[float]]:
    """TTFT and per-chunk times of the engine alone (in-process)."""
    config = MockEngineConfig(
        timing=timing,
        kv_events_endpoint=None,
        kv_events_replay_endpoint=None,
        metrics_endpoint=None,
        num_blocks=4096,
        eos_token_id=257,
    )
    ttft, chunk = [], []
    tokens = list(PROMPT.encode())
    async with MockEngine(config) as engine:
        for i in range(n):
            request = PreprocessedRequest(
                rid=f"direct-{i}",
                token_ids=tokens,
                stop_conditions=StopConditions(max_tokens=MAX_TOKENS),
                sampling_options=SamplingOptions(temperature=0.0),
            )
            start = last = time.perf_counter()
            first = True
            async for _ in engine.generate(request):
                now = time.perf_counter()
                if first:
                    ttft.append(now - start)
                    first = False
                else:
                    chunk.append(now - last)
                last = now
    return ttft, chunk


async def _one(client: httpx.AsyncClient, stream: bool = True) -> tuple[float, list[float], int]:
    body = {
        "model": "mock",
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": stream,
    }
    start = last = time.perf_counter()
    ttft = -1.0
    gaps: list[float] = []
    chunks = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            if ttft < 0:
                ttft = now - start
            else:
                gaps.append(now - last)
            last = now
            chunks += 1
    return ttft, gaps, chunks


async def served(port: int, pid: int, quick: bool) -> dict[str, Any]:
    proc = psutil.Process(pid)
    limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=120
    ) as client:
        for _ in range(20):
            await _one(client)
        ttfts, gaps = [], []
        for _ in range(100 if quick else 1000):
            ttft, g, _ = await _one(client)
            ttfts.append(ttft)
            gaps.extend(g)
        rates = {}
        cpu_per_req = []
        for concurrency in (1, 32, 256):
            total = max(concurrency * (2 if quick else 8), 50 if quick else 400)
            done = 0
            cpu_before = sum(proc.cpu_times()[:2])
            start = time.perf_counter()

            async def worker(count: int) -> None:
                nonlocal done
                for _ in range(count):
                    await _one(client)
                    done += 1

            async with anyio.create_task_group() as tg:
                per = total // concurrency
                for _ in range(concurrency):
                    tg.start_soon(worker, per)
            elapsed = time.perf_counter() - start
            rates[concurrency] = done / elapsed
            cpu_per_req.append((sum(proc.cpu_times()[:2]) - cpu_before) / done)
    return {"ttft": ttfts, "gaps": gaps, "rates": rates, "cpu_per_req": cpu_per_req}


def start_root(port: int, mode: str, timing: TimingModel) -> subprocess.Popen[bytes]:
    timing_arg = f"timing={msgspec.json.encode(timing).decode()}"
    args = [
        sys.executable,
        "-m",
        "supervisors._cli_main",
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
        "--model",
        "mock",
        "--engine-arg",
        timing_arg,
        "--engine-arg",
        "num_blocks=8192",
        "--engine-arg",
        "eos_token_id=257",
        "--control",
        f"/tmp/actorserve-bench-{os.getpid()}.ctl",
    ]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def steady_gaps(port: int, n: int) -> list[float]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
        gaps: list[float] = []
        for _ in range(n):
            gaps.extend((await _one(client))[1])
    return gaps


async def main_async(quick: bool, mode: str) -> dict[str, Any]:
    n = 100 if quick else 1000
    direct_ttft, _ = await engine_direct(n, TimingModel(instant=True))
    _, direct_chunk = await engine_direct(n // 4, STEADY)
    port = free_port()
    root = start_root(port, mode, TimingModel(instant=True))
    try:
        await wait_healthy(port)
        result = await served(port, root.pid, quick)
    finally:
        root.terminate()
        await anyio.to_thread.run_sync(root.wait, 60)
    port = free_port()
    root = start_root(port, mode, STEADY)
    try:
        await wait_healthy(port)
        result["gaps"] = await steady_gaps(port, n // 4)
    finally:
        root.terminate()
        await anyio.to_thread.run_sync(root.wait, 60)
    ttft_over = [t - percentile(direct_ttft, 50) for t in result["ttft"]]
    return {
        "ttft_overhead_ms_p50": round(percentile(ttft_over, 50) * 1e3, 3),
        "ttft_overhead_ms_p99": round(percentile(ttft_over, 99) * 1e3, 3),
        "chunk_overhead_us_p50": round(
            (percentile(result["gaps"], 50) - percentile(direct_chunk, 50)) * 1e6, 1
        ),
        "req_per_s_c1": round(result["rates"][1], 1),
        "req_per_s_c32": round(result["rates"][32], 1),
        "req_per_s_c256": round(result["rates"][256], 1),
        "cpu_ms_per_req": round(min(result["cpu_per_req"]) * 1e3, 3),
        "engine_ttft_ms_p50": round(percentile(direct_ttft, 50) * 1e3, 3),
        "mode": mode,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (under 60 s)")
    parser.add_argument("--mode", default="aggregated", choices=["aggregated", "disaggregated"])
    args = parser.parse_args()
    r = anyio.run(main_async, args.quick, args.mode)
    rows = [
        ("TTFT overhead p50 (ms)", r["ttft_overhead_ms_p50"], "goal <= 1; over the engine alone"),
        ("TTFT overhead p99 (ms)", r["ttft_overhead_ms_p99"], ""),
        (
            "per-chunk overhead p50 (us)",
            r["chunk_overhead_us_p50"],
            "goal <= 50; served gap - engine gap",
        ),
        ("requests/s, concurrency 1", r["req_per_s_c1"], f"{MAX_TOKENS} tokens each"),
        ("requests/s, concurrency 32", r["req_per_s_c32"], ""),
        ("requests/s, concurrency 256", r["req_per_s_c256"], ""),
        ("root CPU per request (ms)", r["cpu_ms_per_req"], "goal <= 1; best of the three loads"),
        ("engine alone TTFT p50 (ms)", r["engine_ttft_ms_p50"], "in-process, instant mode"),
    ]
    report(f"serving path ({r['mode']}, mock engines in child processes, instant mode)", rows, r)


if __name__ == "__main__":
    main()
