"""Benchmark of the ``hf`` engine on SmolLM2-135M-Instruct (fp32, CPU or CUDA): alone, and served.

    python -m benchmarks.hf_engine [--max-tokens 32] [--threads N] [--backend asyncio|trio]

The engine alone:

- ``hf_generate_tokens_per_s``: transformers' own ``model.generate`` (greedy, one prompt at a
  time), the baseline.
- ``engine_tokens_per_s_batch1``: the engine, one request at a time.
- ``engine_tokens_per_s`` (headline) / ``engine_tokens_per_s_batch4``: four concurrent requests
  batched by the engine; completion tokens / wall time.
- ``engine_ttft_ms_p50``: time from submission to the first token, one request at a time.

Served: the serving tree of ``actorserve run`` with its root in this process (engines in their
own processes), driven over HTTP (streamed ``/v1/completions``, token-id prompts):

- ``served_tokens_per_s`` (headline) / ``served_tokens_per_s_batch1``: aggregated, one worker
  (the engine alone's setup plus the runtime: frontend, request-stream actor, router, the
  process boundary), four concurrent requests / one at a time;
- ``ttft_ms_agg_p50``: time from the HTTP request to its first streamed token, one request at a
  time, aggregated;
- ``ttft_ms_disagg_p50`` / ``served_tokens_per_s_disagg``: the same disaggregated, one prefill and
  two decode workers (``actorserve run``'s default): prefill, KV moved over NIXL, decode.

Every request is greedy with ``ignore_eos`` so each produces exactly ``--max-tokens`` tokens.
CPU time (this process and its children) is shown next to wall time: these machines are shared.
Served engines use ``--threads`` torch threads (default: what the serving tree picks, one per
core shared among its engines).

A table first, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import psutil
import structlog
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.serving import ServeConfig
from actors.serving.engines import HFEngine, HFEngineConfig, find_smollm2, load_model
from benchmarks._common import served_tree
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


def _tree_cpu_s() -> float:
    """CPU seconds of this process and its children (the served engines run in children)."""
    total = 0.0
    for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


async def _served_one(
    client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, ttft: list[float]
) -> int:
    """One streamed completion; its completion tokens (from usage), its TTFT into ``ttft``."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, first, tokens = time.perf_counter(), True, 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"served request failed: {event['error']}")
            if first and event.get("choices"):
                first = False
                ttft.append((time.perf_counter() - start) * 1000)
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
    return tokens


async def served_throughput(
    name: str,
    client: httpx.AsyncClient,
    model: str,
    prompts: list[list[int]],
    max_tokens: int,
    batch: int,
    n_requests: int,
) -> Throughput:
    """``n_requests`` over HTTP, ``batch`` at a time, prompts cycled."""
    ttft: list[float] = []
    counts: list[int] = []
    wall, cpu = time.perf_counter(), _tree_cpu_s()
    for start in range(0, n_requests, batch):

        async def run(i: int) -> None:
            prompt = prompts[i % len(prompts)]
            counts.append(await _served_one(client, model, prompt, max_tokens, ttft))

        async with anyio.create_task_group() as tg:
            for i in range(start, min(start + batch, n_requests)):
                tg.start_soon(run, i)
    return Throughput(
        name, batch, sum(counts), time.perf_counter() - wall, _tree_cpu_s() - cpu, ttft
    )


async def measure_served(
    args: argparse.Namespace, mode: str
) -> tuple[list[Throughput], dict[str, Any]]:
    """The serving tree (``mode``), root in this process, over HTTP: batch 1 (TTFT) and 4."""
    files = find_smollm2()
    prompts = chat_prompts(files.tokenizer_path)
    engine_args: dict[str, Any] = {}
    if args.threads is not None:
        engine_args["num_threads"] = args.threads
    topology: dict[str, Any] = (
        {"mode": "aggregated", "decode_workers": 1}
        if mode == "aggregated"
        else {"mode": "disaggregated", "prefill_workers": 1, "decode_workers": 2}
    )
    config = ServeConfig(backend="hf", port=0, engine_args=engine_args, **topology)
    async with served_tree(config) as serving:
        url = f"http://127.0.0.1:{serving.port}"
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            model = config.model
            for prompt in prompts:  # warm-up: every worker has run a request
                await _served_one(client, model, prompt, 2, [])
            short = "agg" if mode == "aggregated" else "disagg"
            batch1 = await served_throughput(
                f"served {short}, batch 1",
                client,
                model,
                prompts,
                args.max_tokens,
                1,
                args.ttft_requests,
            )
            batch4 = await served_throughput(
                f"served {short}, batch 4", client, model, prompts, args.max_tokens, 4, 8
            )
    if mode == "aggregated":
        metrics: dict[str, Any] = {
            "served_tokens_per_s": round(batch4.tokens_per_s, 2),
            "served_tokens_per_s_batch1": round(batch1.tokens_per_s, 2),
            "ttft_ms_agg_p50": round(statistics.median(batch1.ttft_ms), 1),
        }
    else:
        metrics = {
            "served_tokens_per_s_disagg": round(batch4.tokens_per_s, 2),
            "served_tokens_per_s_disagg_batch1": round(batch1.tokens_per_s, 2),
            "ttft_ms_disagg_p50": round(statistics.median(batch1.ttft_ms), 1),
        }
    metrics[f"served_threads_{mode}"] = (
        serving.hf_threads() if args.threads is None else args.threads
    )
    return [batch1, batch4], metrics


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
    Console(width=120).print(table)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    """Every measurement, merged into one table and one JSON line."""
    rows, metrics = await measure_engine(args)
    if not args.skip_served:
        for mode in ("aggregated", "disaggregated"):
            served_rows, served = await measure_served(args, mode)
            rows += served_rows
            metrics.update(served)
        metrics["served_vs_engine"] = round(
            metrics["served_tokens_per_s"] / metrics["engine_tokens_per_s"], 3
        )
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
    parser.add_argument(
        "--skip-served", action="store_true", help="skip the serving-tree measurements"
    )
    parser.add_argument(
        "--ttft-requests", type=int, default=8, help="sequential served requests per mode"
    )
    args = parser.parse_args()
    # The serving tree logs every request-stream actor's start and exit at debug level.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    result = anyio.run(main_async, args, backend=args.backend)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
