"""Benchmark of the ``hf`` engine alone on SmolLM2-135M-Instruct (fp32, CPU or CUDA).

    python benchmarks/hf_engine.py [--max-tokens 32] [--threads N] [--backend asyncio|trio]

- ``hf_generate_tokens_per_s``: transformers' own ``model.generate`` (greedy, one prompt at a
  time), the baseline.
- ``engine_tokens_per_s_batch1``: the engine, one request at a time.
- ``engine_tokens_per_s`` (headline) / ``engine_tokens_per_s_batch4``: four concurrent requests
  batched by the engine; completion tokens / wall time.
- ``engine_ttft_ms_p50``: time from submission to the first token, one request at a time.

Every request is greedy with ``ignore_eos`` so each produces exactly ``--max-tokens`` tokens.
CPU time is shown next to wall time: these machines are shared.

A table first, then one JSON line. The serving-path numbers of issue 9 (``served_tokens_per_s``
through ``actorserve run``, ``ttft_ms_agg_p50`` / ``ttft_ms_disagg_p50``) belong in further
``measure_*`` functions beside :func:`measure_engine`, merged by :func:`main_async` into the
same rows and JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engines._hf import HFEngine, HFEngineConfig, find_smollm2
from actors.engines._hf._model import load_model
from protocols.engine import (
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three colors.",
    "Explain what a supervisor tree is in one sentence.",
]


@dataclass(frozen=True)
class Throughput:
    """One measurement: tokens produced, wall and CPU seconds, time to first token per request."""

    name: str
    batch: int
    tokens: int
    wall_s: float
    cpu_s: float
    ttft_ms: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def chat_prompts(tokenizer_path: Path) -> list[list[int]]:
    """The benchmark prompts through the model's chat template."""
    from transformers import AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(str(tokenizer_path))  # partially typed upstream
    return [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False
            )
        )
        for q in QUESTIONS
    ]


def hf_generate_throughput(folder: Path, prompts: list[list[int]], max_tokens: int) -> Throughput:
    """transformers' ``generate``, greedy, one prompt at a time (after one warm-up call)."""
    model = load_model(folder, "cuda" if torch.cuda.is_available() else "cpu")
    device = model.device
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]], device=device), do_sample=False, max_new_tokens=2)
        wall, cpu, tokens = time.perf_counter(), time.process_time(), 0
        for p in prompts:
            out = model.generate(
                torch.tensor([p], device=device),
                do_sample=False,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
            )
            tokens += out.shape[1] - len(p)
    return Throughput(
        "transformers generate",
        1,
        tokens,
        time.perf_counter() - wall,
        time.process_time() - cpu,
        [],
    )


def _request(rid: str, prompt: list[int], max_tokens: int) -> PreprocessedRequest:
    return PreprocessedRequest(
        rid=rid,
        token_ids=prompt,
        stop_conditions=StopConditions(max_tokens=max_tokens, ignore_eos=True),
        sampling_options=SamplingOptions(temperature=0.0),
    )


async def _one(engine: HFEngine, req: PreprocessedRequest, ttft: list[float]) -> int:
    start, n = time.perf_counter(), 0
    async for out in engine.generate(req):
        if n == 0:
            ttft.append((time.perf_counter() - start) * 1000)
        n += len(out.token_ids)
    return n


async def engine_throughput(
    engine: HFEngine, prompts: list[list[int]], max_tokens: int, batch: int
) -> Throughput:
    """The engine alone: ``batch`` requests at a time over ``prompts`` (cycled to 4 * batch /
    batch rounds), completion tokens over wall time."""
    ttft: list[float] = []
    counts: list[int] = []
    wall, cpu = time.perf_counter(), time.process_time()
    n_requests = max(len(prompts), batch)
    for start in range(0, n_requests, batch):

        async def run(i: int) -> None:
            req = _request(f"b{batch}-{i}", prompts[i % len(prompts)], max_tokens)
            counts.append(await _one(engine, req, ttft))

        async with anyio.create_task_group() as tg:
            for i in range(start, min(start + batch, n_requests)):
                tg.start_soon(run, i)
    return Throughput(
        f"hf engine, batch {batch}",
        batch,
        sum(counts),
        time.perf_counter() - wall,
        time.process_time() - cpu,
        ttft,
    )


async def measure_engine(args: argparse.Namespace) -> tuple[list[Throughput], dict[str, Any]]:
    """The engine alone (and transformers' ``generate`` as the baseline): rows and metrics."""
    files = find_smollm2()
    prompts = chat_prompts(files.tokenizer_path)
    rows: list[Throughput] = []
    if not args.skip_hf:
        rows.append(hf_generate_throughput(files.folder, prompts, args.max_tokens))
    engine = HFEngine(HFEngineConfig(num_threads=args.threads))
    try:
        await engine.start()
        await _one(engine, _request("warm", prompts[0], 2), [])
        batch1 = await engine_throughput(engine, prompts, args.max_tokens, 1)
        batch4 = await engine_throughput(engine, prompts, args.max_tokens, 4)
    finally:
        await engine.cleanup()
    rows += [batch1, batch4]
    metrics: dict[str, Any] = {
        "engine_tokens_per_s": round(batch4.tokens_per_s, 2),
        "engine_tokens_per_s_batch1": round(batch1.tokens_per_s, 2),
        "engine_tokens_per_s_batch4": round(batch4.tokens_per_s, 2),
        "engine_cpu_ms_per_token_batch1": round(batch1.cpu_s / batch1.tokens * 1000, 1),
        "engine_cpu_ms_per_token_batch4": round(batch4.cpu_s / batch4.tokens * 1000, 1),
        "engine_ttft_ms_p50": round(statistics.median(batch1.ttft_ms), 1),
    }
    if not args.skip_hf:
        metrics["hf_generate_tokens_per_s"] = round(rows[0].tokens_per_s, 2)
    return rows, metrics


def print_table(rows: list[Throughput], max_tokens: int) -> None:
    """The human-readable table (before the JSON line)."""
    table = Table(title=f"hf engine, SmolLM2-135M fp32, {max_tokens} tokens/request")
    for col in ("run", "batch", "tokens", "wall s", "cpu s", "tokens/s", "ttft ms p50"):
        table.add_column(col, justify="right" if col != "run" else "left")
    for r in rows:
        ttft = f"{statistics.median(r.ttft_ms):.0f}" if r.ttft_ms else "-"
        table.add_row(
            r.name,
            str(r.batch),
            str(r.tokens),
            f"{r.wall_s:.2f}",
            f"{r.cpu_s:.2f}",
            f"{r.tokens_per_s:.1f}",
            ttft,
        )
    Console().print(table)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    """Every measurement; the serving-path ones (``served_tokens_per_s``, TTFT aggregated vs
    disaggregated) join here as further ``measure_*`` calls once ``actorserve run`` exists."""
    rows, metrics = await measure_engine(args)
    print_table(rows, args.max_tokens)
    return {
        **metrics,
        "max_tokens": args.max_tokens,
        "torch_threads": torch.get_num_threads(),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--skip-hf", action="store_true", help="skip the transformers baseline")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    result = anyio.run(main_async, args, backend=args.backend)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
