"""Lifecycle costs: the token gap of a request moved off a draining decode worker (live KV
migration vs token replay), drain time, and release/resume orchestration overhead.

    python -m benchmarks.lifecycle [--quick]

A disaggregated serving tree runs in this process (one prefill and two decode mock engines in
child processes, the default timing model, KV over NIXL). Requests with a 4k-token context all
decode on decode-0, which is then drained under them: four times with live KV migration (the
default; the first is the worker pair's first hand-over, reported apart; the other three are
pooled: a drain's requests move together, so one drain is nearer one sample than sixteen), with
token replay (``live=False``) while the prefill worker still caches the contexts, with token
replay after its cache was flushed (the whole context is prefilled again), and three times more
with live migration of a lone request. A request's migration gap is its longest client-side
token gap around the drain. The clients are a process of their own
(``benchmarks._stream_client``: one thread and connection per stream), as a server's clients
are; until 2026-11-22 they were an httpx client in the serving process, whose parsing of every
stream's chunks shared the root's event loop with the drain's work (figures before that date are
not comparable).

Prints a table, then one JSON line with live_migration_gap_ms_p50,
live_migration_first_gap_ms_p50, replay_migration_gap_ms_p50 (the full re-prefill),
replay_cached_migration_gap_ms_p50, normal_token_gap_ms_p50, live_migration_extra_ms_p50 (the
live gap beyond the request's own median token gap, over the three drains;
live_migration_extra_ms_p50_per_drain: each drain's; live_migration_extra_ms_1_inflight: the same
for a drain with one request in flight, median of three), live_write_ms_sum and
live_write_ms_mean (a live drain's KV WRITEs, each from its posting to NIXL's DONE as the
draining worker saw it: summed (median drain), and per context handed over; since 2026-11-22
the contexts whose page lists are there at the boundary share one WRITE, counted once),
drain_s_16_inflight (median live drain; 8 in flight with --quick), drain_replay_s,
release_overhead_ms and resume_overhead_ms (medians of a lifecycle release or resume of
decode-1's KV cache and weights, less the engine's own release or resume call in it).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from actors import ActorRef, current_registry
from actors.serving import ServeConfig, Serving
from actors.serving.engines import resolve_device
from actors.serving.root import (
    DrainWorker,
    Release,
    Resume,
    UndrainWorker,
)
from actors.serving.worker import engine_name
from actors.telemetry import REGISTRY
from benchmarks._common import percentile, report, served_tree
from protocols import control
from protocols.engine import MemoryTag

ENGINE: dict[str, Any] = {
    "num_blocks": 4096,
    "block_size": 64,
    "context_length": 16384,
    "kv_bytes_per_block": 1024,
    "eos_token_id": 257,
}
CONTEXT = "context " * 512  # ~4k tokens with the byte tokenizer
MAX_TOKENS = 200
LIVE_DRAINS = 3  # live drains pooled for the live figures (one drain's requests move together)
WINDOW_S = 2.0  # the migration gap ends within this long after the drain started


class _Clients:
    def __init__(self, process: Process, stdout: BufferedByteReceiveStream) -> None:
        self._process = process
        self._stdout = stdout

    async def line(self) -> bytes:
        try:
            return await self._stdout.receive_until(b"\n", 1 << 24)
        except (anyio.IncompleteRead, anyio.EndOfStream):
            raise RuntimeError("the stream client failed (its error is above)") from None

    async def times(self) -> list[list[float]]:
        """Each stream's chunk arrival times, once every stream ended."""
        with anyio.fail_after(300):
            times: list[list[float]] = json.loads(await self.line())
            await self._process.wait()
        return times


@contextlib.asynccontextmanager
async def _clients(port: int, prompts: list[str]) -> AsyncIterator[_Clients]:
    """Streams of ``prompts`` from a client process of their own (``benchmarks._stream_client``),
    each past its third chunk when this yields."""
    args = [sys.executable, "-m", "benchmarks._stream_client", str(port), str(MAX_TOKENS)]
    async with await anyio.open_process(args, stderr=None) as process:
        assert process.stdin is not None and process.stdout is not None
        await process.stdin.send(json.dumps(prompts).encode())
        await process.stdin.aclose()
        clients = _Clients(process, BufferedByteReceiveStream(process.stdout))
        try:
            with anyio.fail_after(120):
                line = await clients.line()
            if line != b"started":
                raise RuntimeError(f"the stream client said {line[:200]!r}, not started")
            yield clients
        except BaseException:
            process.kill()  # else leaving waits for its streams to end
            raise


class Bench:
    def __init__(self, serving: Serving, inflight: int) -> None:
        self.serving = serving
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
        table = self.serving.model().table
        prompts = [f"{tag} {i} {CONTEXT}" for i in range(inflight or self.inflight)]
        table.set_draining("decode-1", True)  # every request starts on decode-0
        port = self.serving.port
        assert port is not None  # the tree serves HTTP
        async with _clients(port, prompts) as clients:
            table.set_draining("decode-1", False)
            if flush:
                assert await self.engine("prefill-0").ask(control.FlushCache())
            wrote = await self.writes("decode-0")
            drained_at = time.perf_counter()
            await self.lifecycle.ask(DrainWorker("decode-0", live=live), timeout=None)
            drain_s = time.perf_counter() - drained_at
            streams = await clients.times()
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
            released = _stage_seconds("release", "release_memory")
            resumed = _stage_seconds("resume", "resume_memory")
            t0 = time.perf_counter()
            await self.lifecycle.ask(Release(worker="decode-1", tags=tags), timeout=None)
            t1 = time.perf_counter()
            await self.lifecycle.ask(Resume(worker="decode-1"), timeout=None)
            t2 = time.perf_counter()
            release.append(t1 - t0 - (_stage_seconds("release", "release_memory") - released))
            resume.append(t2 - t1 - (_stage_seconds("resume", "resume_memory") - resumed))
        return release, resume


def _stage_seconds(operation: str, stage: str) -> float:
    """Seconds the stage has taken in all its runs so far (its histogram's sum)."""
    labels = {"operation": operation, "stage": stage}
    name = "actorserve_lifecycle_stage_duration_seconds_sum"
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def measure(quick: bool) -> dict[str, Any]:
    config = ServeConfig(
        model="mock",
        backend="mock",
        mode="disaggregated",
        prefill_workers=1,
        decode_workers=2,
        port=0,
        engine_args=ENGINE,
    )
    async with served_tree(config, drain_s=60.0) as serving:
        gc.freeze()  # as run_root does once the tree is up
        bench = Bench(serving, 8 if quick else 16)
        first = await bench.drain("first", live=True)  # these two workers' first hand-over
        lives = [await bench.drain(f"live{i}", live=True) for i in range(LIVE_DRAINS)]
        cached = await bench.drain("cached", live=False)
        cold = await bench.drain("cold", live=False, flush=True)
        alone = [await bench.drain(f"alone{i}", live=True, inflight=1) for i in range(3)]
        release, resume = await bench.release_resume(5 if quick else 15)
    extras = [[m - n for m, n in zip(r["migration"], r["normal"], strict=True)] for r in lives]
    pooled = {key: [value for r in lives for value in r[key]] for key in ("migration", "normal")}
    normal = [*pooled["normal"], *cached["normal"], *cold["normal"]]
    return {
        "live_migration_gap_ms_p50": percentile(pooled["migration"], 50) * 1e3,
        "live_migration_first_gap_ms_p50": percentile(first["migration"], 50) * 1e3,
        "replay_migration_gap_ms_p50": percentile(cold["migration"], 50) * 1e3,
        "replay_cached_migration_gap_ms_p50": percentile(cached["migration"], 50) * 1e3,
        "normal_token_gap_ms_p50": percentile(normal, 50) * 1e3,
        "live_migration_extra_ms_p50": percentile([e for x in extras for e in x], 50) * 1e3,
        "live_migration_extra_ms_p50_per_drain": [percentile(x, 50) * 1e3 for x in extras],
        "live_migration_extra_ms_1_inflight": statistics.median(
            r["migration"][0] - r["normal"][0] for r in alone
        )
        * 1e3,
        "live_write_ms_sum": statistics.median(r["write_s"] for r in lives) * 1e3,
        "live_write_ms_mean": sum(r["write_s"] for r in lives)
        * 1e3
        / max(1, sum(r["writes"] for r in lives)),
        "drain_s_16_inflight": statistics.median(r["drain_s"] for r in lives),
        "drain_replay_s": cold["drain_s"],
        "release_overhead_ms": statistics.median(release) * 1e3,
        "resume_overhead_ms": statistics.median(resume) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 requests in flight (under 60 s)")
    args = parser.parse_args()
    r: dict[str, Any] = {
        k: [round(x, 3) for x in v] if isinstance(v, list) else round(v, 3)
        for k, v in anyio.run(measure, args.quick).items()
    }
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
        ("  ... per context (ms)", r["live_write_ms_mean"], "a shared WRITE's share"),
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
