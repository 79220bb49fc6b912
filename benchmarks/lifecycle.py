"""Lifecycle costs: the token gap of a request moved off a draining decode worker (live KV
migration vs token replay), drain time, and release/resume orchestration overhead.

    python -m benchmarks.lifecycle [--quick]

A disaggregated serving tree runs in this process (one prefill and two decode mock engines in
child processes, the default timing model, KV over NIXL). Requests with a 4k-token context all
decode on decode-0, which is then drained under them: twice with live KV migration (the
default; the first is the worker pair's first hand-over, reported apart), with token replay
(``live=False``) while the prefill worker still caches the contexts, with token replay after
its cache was flushed (the whole context is prefilled again), and three times more with live
migration of a lone request. A request's migration gap is its longest client-side token gap
around the drain. The HTTP client runs in the serving process too (as in every benchmark
here), so on a small machine concurrent migrations queue for its CPU.

Prints a table, then one JSON line with live_migration_gap_ms_p50,
live_migration_first_gap_ms_p50, replay_migration_gap_ms_p50 (the full re-prefill),
replay_cached_migration_gap_ms_p50, normal_token_gap_ms_p50, live_migration_extra_ms_p50 (the
live gap beyond the request's own median token gap; live_migration_extra_ms_1_inflight: the same
for a drain with one request in flight, median of three), live_write_ms_sum and
live_write_ms_mean (that live drain's KV WRITEs, each from its posting to NIXL's DONE as the
draining worker saw it: summed, and per WRITE; they overlap each other and the rest of the
drain, so neither is a term of the gap), drain_s_16_inflight (the live drain; 8 in flight
with --quick), drain_replay_s, release_overhead_ms and resume_overhead_ms (medians of a lifecycle
release or resume of decode-1's KV cache and weights, less the engine's own release or resume
call in it).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import time
from typing import Any

import anyio
import httpx

from actors import ActorRef, current_registry
from actors.engines._mock._kvmem import resolve_device
from actors.serving import ServeConfig, Serving
from actors.telemetry import REGISTRY
from actors.worker import engine_name
from benchmarks._common import percentile, report
from protocols import control
from protocols.engine import MemoryTag
from supervisors import SupervisorFlags, open_supervisor
from supervisors._lifecycle import Budgets, DrainWorker, Release, Resume, UndrainWorker
from supervisors._root import RootOptions, serving_children

ENGINE: dict[str, Any] = {
    "num_blocks": 4096,
    "block_size": 64,
    "context_length": 16384,
    "kv_bytes_per_block": 1024,
    "eos_token_id": 257,
}
CONTEXT = "context " * 512  # ~4k tokens with the byte tokenizer
MAX_TOKENS = 200
WINDOW_S = 2.0  # the migration gap ends within this long after the drain started


async def _stream(
    client: httpx.AsyncClient, prompt: str, times: list[float], started: list[anyio.Event]
) -> None:
    """Stream ``prompt``, noting when each chunk arrives; sets and drops ``started[0]`` after
    the third chunk."""
    body = {
        "model": "mock",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    async with client.stream("POST", "/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            times.append(time.perf_counter())
            if len(times) == 3:
                started.pop().set()


class Bench:
    def __init__(self, serving: Serving, client: httpx.AsyncClient, inflight: int) -> None:
        self.serving = serving
        self.client = client
        self.inflight = inflight
        lifecycle = current_registry().whereis("lifecycle")
        assert lifecycle is not None
        self.lifecycle: ActorRef[Any] = lifecycle

    def engine(self, worker: str) -> ActorRef[Any]:
        ref = current_registry().whereis(engine_name(worker))
        assert ref is not None
        return ref

    async def drain(
        self, tag: str, *, live: bool, flush: bool = False, inflight: int = 0
    ) -> dict[str, Any]:
        """Start ``inflight`` requests on decode-0, drain it under them, wait for them."""
        table = self.serving.table
        streams: list[list[float]] = [[] for _ in range(inflight or self.inflight)]
        started = [anyio.Event() for _ in streams]
        async with anyio.create_task_group() as tg:
            table.set_draining("decode-1", True)  # every request starts on decode-0
            for i, times in enumerate(streams):
                tg.start_soon(_stream, self.client, f"{tag} {i} {CONTEXT}", times, started)
            with anyio.fail_after(120):
                for event in list(started):
                    await event.wait()
            table.set_draining("decode-1", False)
            if flush:
                assert await self.engine("prefill-0").ask(control.FlushCache())
            wrote = await self.writes("decode-0")
            drained_at = time.perf_counter()
            await self.lifecycle.ask(DrainWorker("decode-0", live=live), timeout=None)
            drain_s = time.perf_counter() - drained_at
        await self.lifecycle.ask(UndrainWorker("decode-0"), timeout=None)
        # The WRITEs are over once every request continued elsewhere (they did, above).
        write_s, writes = await self.writes("decode-0")
        migration, normal = [], []
        for times in streams:
            gaps = [(b - a, b) for a, b in itertools.pairwise(times)]
            around = [g for g, end in gaps if drained_at < end < drained_at + WINDOW_S]
            migration.append(max(around))
            normal.append(statistics.median(g for g, _ in gaps))
        return {
            "migration": migration,
            "normal": normal,
            "drain_s": drain_s,
            "write_s": write_s - wrote[0],
            "writes": writes - wrote[1],
        }

    async def writes(self, worker: str) -> tuple[float, int]:
        """The KV WRITEs ``worker``'s hand-overs made so far: their time, each from its posting
        to DONE, summed, and how many (one per live hand-over)."""
        stats: control.EngineStats = await self.engine(worker).ask(control.GetStats())
        return stats.kv_write_seconds, stats.handovers_live

    async def release_resume(self, reps: int) -> tuple[list[float], list[float]]:
        """Lifecycle release and resume times of decode-1 less the engine's own release or
        resume call in them (the ``release_memory`` / ``resume_memory`` stage)."""
        tags = (MemoryTag.KV_CACHE, MemoryTag.WEIGHTS)
        release, resume = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            await self.lifecycle.ask(Release(worker="decode-1", tags=tags), timeout=None)
            t1 = time.perf_counter()
            await self.lifecycle.ask(Resume(worker="decode-1"), timeout=None)
            t2 = time.perf_counter()
            release.append(t1 - t0 - _stage_seconds("release", "release_memory"))
            resume.append(t2 - t1 - _stage_seconds("resume", "resume_memory"))
        return release, resume


def _stage_seconds(operation: str, stage: str) -> float:
    labels = {"operation": operation, "stage": stage}
    value = REGISTRY.get_sample_value("actorserve_lifecycle_stage_seconds", labels)
    assert value is not None
    return value


async def measure(quick: bool) -> dict[str, float]:
    config = ServeConfig(
        model="mock",
        backend="mock",
        mode="disaggregated",
        prefill_workers=1,
        decode_workers=2,
        port=0,
        engine_args=ENGINE,
    )
    serving = Serving(config)
    budgets = Budgets(grace=0.0, release_grace=0.0, drain=60.0)
    children = serving_children(serving, RootOptions(budgets=budgets), lambda: None)
    async with open_supervisor(children, SupervisorFlags(intensity=10, period=60)):
        await serving.table.wait_routable(3)
        gc.freeze()  # as run_root does once the tree is up
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{serving.port}") as client:
            bench = Bench(serving, client, 8 if quick else 16)
            first = await bench.drain("first", live=True)  # these two workers' first hand-over
            live = await bench.drain("live", live=True)
            cached = await bench.drain("cached", live=False)
            cold = await bench.drain("cold", live=False, flush=True)
            alone = [await bench.drain(f"alone{i}", live=True, inflight=1) for i in range(3)]
            release, resume = await bench.release_resume(5 if quick else 15)
    extra = [m - n for m, n in zip(live["migration"], live["normal"], strict=True)]
    normal = [*live["normal"], *cached["normal"], *cold["normal"]]
    return {
        "live_migration_gap_ms_p50": percentile(live["migration"], 50) * 1e3,
        "live_migration_first_gap_ms_p50": percentile(first["migration"], 50) * 1e3,
        "replay_migration_gap_ms_p50": percentile(cold["migration"], 50) * 1e3,
        "replay_cached_migration_gap_ms_p50": percentile(cached["migration"], 50) * 1e3,
        "normal_token_gap_ms_p50": percentile(normal, 50) * 1e3,
        "live_migration_extra_ms_p50": percentile(extra, 50) * 1e3,
        "live_migration_extra_ms_1_inflight": statistics.median(
            r["migration"][0] - r["normal"][0] for r in alone
        )
        * 1e3,
        "live_write_ms_sum": live["write_s"] * 1e3,
        "live_write_ms_mean": live["write_s"] * 1e3 / max(1, live["writes"]),
        "drain_s_16_inflight": live["drain_s"],
        "drain_replay_s": cold["drain_s"],
        "release_overhead_ms": statistics.median(release) * 1e3,
        "resume_overhead_ms": statistics.median(resume) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 requests in flight (under 60 s)")
    args = parser.parse_args()
    r: dict[str, Any] = {k: round(v, 3) for k, v in anyio.run(measure, args.quick).items()}
    r["kv_device"] = resolve_device("auto")  # the engines' default: VRAM where a GPU is present
    rows = [
        ("live KV migration gap p50 (ms)", r["live_migration_gap_ms_p50"], "4k context"),
        (
            "  the pair's first hand-over (ms)",
            r["live_migration_first_gap_ms_p50"],
            "first WRITE between the two",
        ),
        (
            "  beyond the request's own token gap (ms)",
            r["live_migration_extra_ms_p50"],
            "goal <= 10 plus the transfer",
        ),
        (
            "  ... with one request in flight (ms)",
            r["live_migration_extra_ms_1_inflight"],
            "median of 3 drains",
        ),
        (
            "  the drain's KV WRITEs, summed (ms)",
            r["live_write_ms_sum"],
            "posting to DONE; they overlap",
        ),
        ("  ... per WRITE (ms)", r["live_write_ms_mean"], "one context's"),
        ("token-replay gap p50 (ms)", r["replay_migration_gap_ms_p50"], "context prefilled again"),
        (
            "token-replay gap p50, prefix cached (ms)",
            r["replay_cached_migration_gap_ms_p50"],
            "the prefill worker kept the context",
        ),
        ("normal token gap p50 (ms)", r["normal_token_gap_ms_p50"], "for comparison"),
        ("drain, live (s)", r["drain_s_16_inflight"], "grace 0"),
        ("drain, token replay (s)", r["drain_replay_s"], "grace 0"),
        ("release orchestration (ms)", r["release_overhead_ms"], "goal <= 5; beyond the engine's"),
        ("resume orchestration (ms)", r["resume_overhead_ms"], "goal <= 5"),
    ]
    report("lifecycle (disaggregated, mock engines in child processes)", rows, r)


if __name__ == "__main__":
    main()
