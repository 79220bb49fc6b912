"""SGLang alone against ``actorserve run --backend sglang`` in front of the same SGLang (GPU host).

    python -m benchmarks.sglang_gpu [--quick]    (on the GPU host, after tests/gpu/run.sh's
                                                  setup: see docs/pages/development.md)

One after the other, with the same engine flags and the same load generator: SGLang's own
``launch_server`` (its OpenAI API), actorserve's root with one aggregated SGLang worker, then
SGLang alone again. The baseline is the mean of SGLang's two passes (drift over the run cancels),
and their difference is the run's noise floor: a gap to SGLang smaller than it is not measurable.
The model is Llama-3.1-8B's shape with SGLang's dummy weights (real speed, no download); its
vocabulary is SmolLM2's, the tokenizer both servers load. Each request: a 512-token prompt (token
ids), 128 output tokens with ``ignore_eos``, streamed. Concurrency 1, 32 and 128; the clients
run in several processes so that they are never the bottleneck. Reported per system and level:
requests/s, output tokens/s, TTFT p50/p99, inter-chunk latency (ITL) p50/p99, and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from benchmarks._common import percentile, report

LLAMA_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "vocab_size": 49152,  # the tokenizer's (SmolLM2's), so every sampled id decodes
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
PROMPT_TOKENS = 512
OUTPUT_TOKENS = 128
CLIENT_PROCESSES = 8
METRICS = ("req_per_s", "tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def engine_flags(model: Path) -> list[str]:
    return [
        *("--model-path", str(model), "--load-format", "dummy"),
        *("--attention-backend", "triton", "--sampling-backend", "pytorch"),
        *("--grammar-backend", "none", "--disable-cuda-graph"),
        *("--mem-fraction-static", "0.8", "--page-size", "16", "--log-level", "warning"),
    ]


def make_model(tokenizer_dir: Path, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(LLAMA_8B))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, dest / name)
    return dest


# -- the load generator -------------------------------------------------------------------


async def _stream(client: httpx.AsyncClient, model: str, prompt: list[int]) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": OUTPUT_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    arrivals: list[float] = []
    start = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if choices and choices[0].get("text"):
                arrivals.append(time.perf_counter())
    return {"start": start, "arrivals": arrivals, "end": time.perf_counter()}


async def _client_share(url: str, model: str, prompts: list[list[int]], streams: int) -> Any:
    queue = list(prompts)
    records: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def worker() -> None:
            while queue:
                records.append(await _stream(client, model, queue.pop()))

        await asyncio.gather(*(worker() for _ in range(streams)))
    return records


def _client_process(url: str, model: str, prompts: list[list[int]], streams: int) -> Any:
    return asyncio.run(_client_share(url, model, prompts, streams))


def run_level(url: str, model: str, concurrency: int, requests: int, seed: int) -> dict[str, Any]:
    """``requests`` streams, ``concurrency`` at a time, spread over client processes."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)] for _ in range(requests)]
    procs = min(CLIENT_PROCESSES, concurrency)
    with ProcessPoolExecutor(procs) as pool:
        futures = [
            pool.submit(
                _client_process,
                url,
                model,
                prompts[i::procs],
                concurrency // procs + (i < concurrency % procs),
            )
            for i in range(procs)
        ]
        records = [r for f in futures for r in f.result()]
    ttft = [(r["arrivals"][0] - r["start"]) * 1000 for r in records if r["arrivals"]]
    itl = [
        (b - a) * 1000
        for r in records
        for a, b in zip(r["arrivals"], r["arrivals"][1:], strict=False)
    ]
    wall = max(r["end"] for r in records) - min(r["start"] for r in records)
    return {
        "requests": len(records),
        "req_per_s": len(records) / wall,
        "tok_per_s": len(records) * OUTPUT_TOKENS / wall,
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "itl_p50_ms": percentile(itl, 50),
        "itl_p99_ms": percentile(itl, 99),
    }


# -- the two servers ----------------------------------------------------------------------


def _wait(
    url: str, ready: Callable[[httpx.Response], bool], proc: subprocess.Popen[bytes], limit: float
) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if ready(httpx.get(url, timeout=5)):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready after {limit} s")


# The GPU host's trimmed SGLang bundle lacks packages that launch_server's HTTP layer imports
# for features this benchmark never uses (audio, Harmony, Ollama, file watching): the baseline's
# process gets empty stand-ins for those that are missing, and nothing else.
_STUBS = ("soundfile", "ollama", "openai_harmony", "watchfiles", "zstandard")
_SITECUSTOMIZE = f"""
import importlib.machinery, importlib.util, sys, types

class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {{}})

for _name in {_STUBS!r}:
    if importlib.util.find_spec(_name) is None:
        sys.modules[_name] = _Stub(_name)
        sys.modules[_name].__spec__ = importlib.machinery.ModuleSpec(_name, None)
"""


def start_sglang(model: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    stubs = Path("/tmp/sglang-baseline-stubs")
    stubs.mkdir(exist_ok=True)
    (stubs / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    env = {**os.environ, "PYTHONPATH": f"{stubs}:{os.environ.get('PYTHONPATH', '')}"}
    args = [sys.executable, "-m", "sglang.launch_server", *engine_flags(model)]
    args += ["--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(args, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    _wait(f"http://127.0.0.1:{port}/health", lambda r: r.status_code == 200, proc, 400)
    return proc


def start_actorserve(model: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "actors.serving", "run", "--backend", "sglang"]
    args += ["--mode", "aggregated", "--decode-workers", "1", "--port", str(port)]
    args += ["--loop", "asyncio", "--tokenizer", str(model), "--router", "round_robin"]
    args += ["--", *engine_flags(model)]
    proc = subprocess.Popen(args, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    _wait(
        f"http://127.0.0.1:{port}/health",
        lambda r: r.status_code == 200 and r.json().get("status") == "ready",
        proc,
        400,
    )
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    # SGLang's launch_server ends its scheduler and detokenizer on SIGTERM; actorserve drains.
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def measure(
    name: str,
    starter: Callable[..., subprocess.Popen[bytes]],
    model: Path,
    levels: list[int],
    requests: dict[int, int],
    out: Path,
) -> dict[int, dict[str, Any]]:
    port = 30000 + random.randrange(1000)
    t0 = time.monotonic()
    proc = starter(model, port, out / f"{name}.log")
    print(f"{name}: ready after {time.monotonic() - t0:.0f} s", flush=True)
    url = f"http://127.0.0.1:{port}"
    try:
        served = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        run_level(url, served, 4, 8, seed=1)  # warm: the first batches of each shape
        results = {}
        for c in levels:
            results[c] = run_level(url, served, c, requests[c], seed=c)
            print(f"{name} c={c}: {json.dumps(results[c])}", flush=True)
        return results
    finally:
        stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests per level")
    parser.add_argument("--tokenizer", type=Path, default=Path(os.environ["ACTORSERVE_GPU_MODEL"]))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")))
    args = parser.parse_args()
    levels = [1, 32, 128]
    requests = {1: 4, 32: 64, 128: 256} if args.quick else {1: 8, 32: 256, 128: 768}
    model = make_model(args.tokenizer, Path("/tmp/llama-3.1-8b-shape"))
    passes: dict[str, dict[int, dict[str, Any]]] = {}
    try:
        for name, starter in (
            ("sglang", start_sglang),
            ("actorserve", start_actorserve),
            ("sglang-again", start_sglang),
        ):
            passes[name] = measure(name, starter, model, levels, requests, args.out)
    except (RuntimeError, TimeoutError) as exc:
        # Without both baselines there are no ratios: say so rather than print half a comparison.
        print(json.dumps({"benchmark": "sglang_gpu", "error": str(exc), **passes}))
        raise SystemExit(1) from exc
    rows: list[tuple[str, Any, str]] = []
    result: dict[str, Any] = {"benchmark": "sglang_gpu", "model": "Llama-3.1-8B shape, dummy"}
    for c in levels:
        first, ours, again = passes["sglang"][c], passes["actorserve"][c], passes["sglang-again"][c]
        base = {key: (first[key] + again[key]) / 2 for key in METRICS}
        rows.extend(
            (
                f"c={c} {key}",
                f"{first[key]:.2f} | {again[key]:.2f} / {ours[key]:.2f}",
                f"x{ours[key] / base[key]:.3f}",
            )
            for key in METRICS
        )
        result[f"sglang_req_per_s_c{c}"] = round(base["req_per_s"], 3)
        result[f"actorserve_req_per_s_c{c}"] = round(ours["req_per_s"], 3)
        result[f"throughput_ratio_c{c}"] = round(ours["tok_per_s"] / base["tok_per_s"], 4)
        result[f"sglang_throughput_spread_c{c}"] = round(
            abs(first["tok_per_s"] - again["tok_per_s"]) / base["tok_per_s"], 4
        )
        result[f"ttft_p50_ms_ratio_c{c}"] = round(ours["ttft_p50_ms"] / base["ttft_p50_ms"], 4)
        result[f"ttft_p50_ms_delta_c{c}"] = round(ours["ttft_p50_ms"] - base["ttft_p50_ms"], 2)
        result[f"sglang_ttft_p50_ms_spread_c{c}"] = round(
            abs(first["ttft_p50_ms"] - again["ttft_p50_ms"]), 2
        )
        result[f"itl_p50_ms_ratio_c{c}"] = round(ours["itl_p50_ms"] / base["itl_p50_ms"], 4)
    report(
        "SGLang alone, twice | and actorserve + SGLang (ratio: actorserve / mean of SGLang's)",
        rows,
        result,
    )


if __name__ == "__main__":
    main()
