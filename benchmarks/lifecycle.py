"""Lifecycle costs: token-replay migration gap on a drain, drain time, release/resume overhead.

    python benchmarks/lifecycle.py [--quick]

The serving tree runs in this process (engines in child processes, mock engine with the default
timing model). Prints a table, then one JSON line with replay_migration_gap_ms_p50 (client-side
token gap of requests handed over by a drain, 4k-token context), drain_s_16_inflight,
release_overhead_ms and resume_overhead_ms (orchestration time beyond the engine's own calls).
Live KV migration is not implemented yet, so live_migration_gap_ms_p50 is not reported.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import anyio
import httpx

from actors import current_registry
from actors.serving import ServeConfig, Serving
from actors.worker import engine_name
from benchmarks._common import percentile, report
from protocols import control
from protocols.engine import MemoryTag
from supervisors import SupervisorFlags, open_supervisor
from supervisors._lifecycle import Budgets, DrainWorker, Release, Resume
from supervisors._root import RootOptions, serving_children

ENGINE: dict[str, Any] = {
    "num_blocks": 4096,
    "block_size": 64,
    "context_length": 16384,
    "kv_bytes_per_block": 1024,
    "eos_token_id": 257,
}


async def _stream(
    client: httpx.AsyncClient,
    prompt: str,
    max_tokens: int,
    gaps: list[float],
    started: list[int],
    all_started: anyio.Event,
    expected: int,
) -> None:
    body = {
        "model": "mock",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    last = None
    async with client.stream("POST", "/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            if last is None:
                started.append(1)
                if len(started) == expected:
                    all_started.set()
            else:
                gaps.append(now - last)
            last = now


async def measure(quick: bool) -> dict[str, float]:
    config = ServeConfig(
        model="mock",
        backend="mock",
        mode="aggregated",
        decode_workers=2,
        port=0,
        engine_args=ENGINE,
    )
    serving = Serving(config)
    budgets = Budgets(grace=0.0, release_grace=0.0, drain=60.0)
    children = serving_children(serving, RootOptions(budgets=budgets), lambda: None)
    inflight = 8 if quick else 16
    async with open_supervisor(children, SupervisorFlags(intensity=10, period=60)):
        await serving.table.wait_routable(2)
        lifecycle = current_registry().whereis("lifecycle")
        assert lifecycle is not None
        prompt = "context " * 512  # ~4k tokens with the byte tokenizer
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{serving.port}") as client:
            gaps: list[float] = []
            started: list[int] = []
            all_started = anyio.Event()
            async with anyio.create_task_group() as tg:
                for i in range(inflight):
                    tg.start_soon(
                        _stream, client, f"{i} {prompt}", 200, gaps, started, all_started, inflight
                    )
                with anyio.fail_after(120):
                    await all_started.wait()
                # Only decode-0 is drained; the requests there migrate by token replay.
                t0 = time.perf_counter()
                await lifecycle.ask(DrainWorker("decode-0"), timeout=None)
                drain_s = time.perf_counter() - t0
        engine = current_registry().whereis(engine_name("decode-0"))
        assert engine is not None
        await engine.ask(control.Undrain())
        serving.table.set_draining("decode-0", False)
        release, resume, raw_release, raw_resume = [], [], [], []
        tags = (MemoryTag.WEIGHTS, MemoryTag.KV_CACHE)
        for _ in range(3 if quick else 10):
            t0 = time.perf_counter()
            await engine.ask(control.ReleaseMemory(tags), timeout=None)
            t1 = time.perf_counter()
            await engine.ask(control.ResumeMemory(tags), timeout=None)
            t2 = time.perf_counter()
            raw_release.append(t1 - t0)
            raw_resume.append(t2 - t1)
            t0 = time.perf_counter()
            await lifecycle.ask(Release(worker="decode-1", tags=tags), timeout=None)
            t1 = time.perf_counter()
            await lifecycle.ask(Resume(worker="decode-1"), timeout=None)
            t2 = time.perf_counter()
            release.append(t1 - t0)
            resume.append(t2 - t1)
    # The largest gap per drained request is its migration gap; the median of all gaps is the
    # normal inter-token time.
    gaps.sort()
    tail = gaps[-inflight // 2 :]
    return {
        "replay_migration_gap_ms_p50": percentile(tail, 50) * 1e3,
        "normal_token_gap_ms_p50": percentile(gaps, 50) * 1e3,
        "drain_s_16_inflight": drain_s,
        "release_overhead_ms": max(0.0, percentile(release, 50) - percentile(raw_release, 50))
        * 1e3,
        "resume_overhead_ms": max(0.0, percentile(resume, 50) - percentile(raw_resume, 50)) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (under 60 s)")
    args = parser.parse_args()
    r = {k: round(v, 3) for k, v in anyio.run(measure, args.quick).items()}
    rows = [
        (
            "token-replay migration gap p50 (ms)",
            r["replay_migration_gap_ms_p50"],
            "drained worker, 4k context",
        ),
        ("normal token gap p50 (ms)", r["normal_token_gap_ms_p50"], "for comparison"),
        ("drain with in-flight requests (s)", r["drain_s_16_inflight"], "hand-over, grace 0"),
        (
            "release orchestration (ms)",
            r["release_overhead_ms"],
            "goal <= 5; beyond the engine's own",
        ),
        ("resume orchestration (ms)", r["resume_overhead_ms"], "goal <= 5"),
    ]
    report("lifecycle (mock engines in child processes)", rows, r)


if __name__ == "__main__":
    main()
