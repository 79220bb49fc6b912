"""Benchmark of the mock engine: timing-model fidelity, instant-mode throughput, cancel cost.

    python -m benchmarks.engine [--quick] [--backend asyncio|trio] [--device auto|cpu|cuda]

- ``timing_model_error_pct``: 1,000 requests (mixed prompt and output lengths, shared prefixes)
  run in timed mode; the time the engine took for its steps (first step's start to last step's
  commit) is compared with the sum of Dynamo's mocker formulas over those steps, recomputed here
  from the step records (not the engine's own numbers). The end-to-end wall time, which also
  pays for submitting 1,000 streams, is shown beside it.
- ``instant_tokens_per_s``: 256 concurrent streams in instant mode, read to the end by 256
  consumer tasks; generated tokens / wall time (the CPU-time rate is shown too: these machines
  are shared).
- ``cancel_free_ms_p50``: a decoding request is cancelled by closing its stream; the time until
  its KV blocks are back in the pool.

A table first, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Literal

import anyio
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anyio.lowlevel

from actors.serving.engines import MockEngine, MockEngineConfig, StepRecord, TimingModel
from protocols.engine import PreprocessedRequest, StopConditions


def _request(rid: str, prompt: list[int], max_tokens: int) -> PreprocessedRequest:
    return PreprocessedRequest(
        rid=rid,
        token_ids=prompt,
        stop_conditions=StopConditions(max_tokens=max_tokens, ignore_eos=True),
    )


async def _drain(engine: MockEngine, req: PreprocessedRequest) -> int:
    n = 0
    async for out in engine.generate(req):
        n += len(out.token_ids)
    return n


def _formula_seconds(records: list[StepRecord], timing: TimingModel) -> float:
    """Dynamo's mocker polynomials over the recorded steps, computed independently."""
    total_ms = 0.0
    for r in records:
        t, p = r.prefill_tokens, r.kv_fraction
        if t:
            total_ms += 4.21e-7 * t * t + 0.0152 * t + 16.5
        if r.decode_requests:
            total_ms += -25.74 * p * p + 54.01 * p + 5.74
    return total_ms / 1000.0 / timing.speedup


DEVICE: Literal["auto", "cpu", "cuda"] = "auto"  # where the KV pages live (--device)


async def timing_fidelity(n: int, speedup: float) -> dict[str, float]:
    timing = TimingModel(speedup=speedup)
    cfg = MockEngineConfig(
        num_blocks=4096,
        block_size=64,
        kv_bytes_per_block=1024,
        weights_bytes=1 << 20,
        device=DEVICE,
        timing=timing,
        record_steps=True,
        kv_events_endpoint=None,
        metrics_endpoint=None,
    )
    rng = random.Random(7)
    prefixes = [[rng.randrange(32000) for _ in range(256)] for _ in range(8)]
    requests = []
    for i in range(n):
        prefix = prefixes[i % len(prefixes)][: rng.choice((0, 64, 128, 256))]
        prompt = prefix + [rng.randrange(32000) for _ in range(rng.randrange(32, 512))]
        requests.append(_request(f"t{i}", prompt, rng.randrange(8, 96)))
    async with MockEngine(cfg) as engine:
        start = anyio.current_time()
        async with anyio.create_task_group() as tg:
            for req in requests:
                tg.start_soon(_drain, engine, req)
        wall = anyio.current_time() - start
        records = engine.step_records()
        stats = engine.statistics().ranks[0]
    formula = _formula_seconds(records, timing)
    span = records[-1].committed - records[0].started
    return {
        "requests": n,
        "steps": len(records),
        "wall_s": wall,
        "span_s": span,
        "formula_s": formula,
        "engine_s": stats.simulated_s,
        "error_pct": abs(span - formula) / formula * 100.0,
        "wall_error_pct": abs(wall - formula) / formula * 100.0,
        "cache_hit_pct": 100.0 * stats.cached_tokens / stats.prompt_tokens,
    }


async def instant_throughput(streams: int, tokens: int) -> dict[str, float]:
    cfg = MockEngineConfig(
        kv_bytes_per_block=1024,
        weights_bytes=1 << 20,
        device=DEVICE,
        max_running_requests=streams,
        timing=TimingModel(instant=True),
    )
    async with MockEngine(cfg) as engine:
        total = 0

        async def one(i: int) -> None:
            nonlocal total
            n = await _drain(engine, _request(f"i{i}", [i, 1, 2, 3, 4, 5, 6, 7], tokens))
            total += n

        start, cpu = time.perf_counter(), time.process_time()
        async with anyio.create_task_group() as tg:
            for i in range(streams):
                tg.start_soon(one, i)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"tokens": total, "wall_s": wall, "per_s": total / wall, "per_cpu_s": total / cpu}


async def cancel_cost(n: int) -> dict[str, float]:
    cfg = MockEngineConfig(
        num_blocks=4096,
        kv_bytes_per_block=1024,
        weights_bytes=1 << 20,
        device=DEVICE,
        timing=TimingModel(speedup=50.0),
    )
    samples: list[float] = []
    async with MockEngine(cfg) as engine:
        for i in range(n):
            stream = engine.generate(_request(f"c{i}", [i % 97, *range(600)], 100_000))
            await stream.__anext__()  # decoding, holding ~10 blocks
            before = engine.statistics().used_blocks
            t0 = time.perf_counter()
            await stream.aclose()
            while engine.statistics().used_blocks >= before:
                await anyio.lowlevel.checkpoint()
            samples.append((time.perf_counter() - t0) * 1000.0)
    return {"cancels": n, "p50_ms": statistics.median(samples), "max_ms": max(samples)}


async def main(quick: bool, console: Console) -> dict[str, float]:
    fidelity = await timing_fidelity(1000, speedup=4.0 if quick else 1.0)
    instant = await instant_throughput(256, 1000 if quick else 4000)
    cancel = await cancel_cost(50 if quick else 200)

    table = Table(title=f"mock engine ({sys.platform}, KV pages: {DEVICE})")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row(
        "timing: requests / steps", f"{fidelity['requests']:.0f} / {fidelity['steps']:.0f}"
    )
    table.add_row("timing: formula s (recomputed)", f"{fidelity['formula_s']:.3f}")
    table.add_row("timing: engine's own s", f"{fidelity['engine_s']:.3f}")
    table.add_row("timing: steps took s", f"{fidelity['span_s']:.3f}")
    table.add_row("timing: error %", f"{fidelity['error_pct']:.3f}")
    table.add_row("timing: end-to-end wall s", f"{fidelity['wall_s']:.3f}")
    table.add_row("timing: end-to-end error %", f"{fidelity['wall_error_pct']:.3f}")
    table.add_row("timing: prefix cache hit %", f"{fidelity['cache_hit_pct']:.1f}")
    table.add_row("instant: tokens", f"{instant['tokens']:,.0f}")
    table.add_row("instant: tokens/s (wall)", f"{instant['per_s']:,.0f}")
    table.add_row("instant: tokens/s (CPU time)", f"{instant['per_cpu_s']:,.0f}")
    table.add_row("cancel: blocks freed p50 ms", f"{cancel['p50_ms']:.4f}")
    table.add_row("cancel: max ms", f"{cancel['max_ms']:.4f}")
    console.print(table)
    return {
        "timing_model_error_pct": round(fidelity["error_pct"], 4),
        "instant_tokens_per_s": round(instant["per_s"]),
        "cancel_free_ms_p50": round(cancel["p50_ms"], 4),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="under 30 s")
    parser.add_argument("--backend", default="asyncio", choices=("asyncio", "trio"))
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    args = parser.parse_args()
    DEVICE = args.device
    console = Console(stderr=False)
    result = anyio.run(main, args.quick, console, backend=args.backend)
    print(json.dumps(result))
