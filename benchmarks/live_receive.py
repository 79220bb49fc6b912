"""The receiving engine's CPU per live-migrated request (the mock engine's side of issue 7).

    python -m benchmarks.live_receive [--quick]

A decode mock engine (the lifecycle benchmark's geometry: 64-token pages of 1 KiB) receives
requests of a 4k-token context as live migrations, one after another: ``open`` is
``generate`` plus ``wait_transfer_target`` (admission, page allocation); ``prepare`` is the
step loop's next turn, which works out the expected KV from the tokens (the context converted
once, every page hashed, the first token's input) while the KV is on its way, as the KV
bridge's wait for the transfer gives it that turn; ``complete`` is ``complete_transfer`` (every
page verified, the pages registered and published, the first token computed). The page bytes
are written before it, as the NIXL WRITE would. CPU time of this thread (``time.thread_time``)
per call, as the machines here are shared, and wall time beside it.

Then the same with a drain's worth of requests landing together (8, as ``lifecycle --quick``
drains, then 16: opened one after another, the step loop's turn, written, then completed in one
``complete_transfers`` call, as the KV bridge does for rooms whose KV arrives in one event-loop
turn): CPU per request of each stage. ``complete`` checks every page first and works out what
they must hold (a live migration comes with the hash of its tokens since 2026-11-22, so the
loop's turn before, ``prepare``, no longer does that for it); ``start`` is that call as the
bridge makes it since then (``overlap=True`` and the hashes the pages came with: the requests
start, and their pages are checked in their first step, off the turn that starts them).

A table first, then one JSON line: receive_open_cpu_us_p50, receive_prepare_cpu_us_p50,
receive_complete_cpu_us_p50, receive_complete_batch_cpu_us_p50 (8 together), and for 8 and 16
together receive_open_batch{N}_cpu_us_p50, receive_prepare_batch{N}_cpu_us_p50,
receive_complete_batch{N}_cpu_us_p50, receive_start_batch{N}_cpu_us_p50; then
receive_first_outputs16_ms_p50: on an idle engine with the default timing model, from the call
completing 16 contexts together (overlapped) to the last of their first outputs (what the
receiving engine adds to a drain's token gap, its one decode step included).
"""

from __future__ import annotations

import argparse
import random
import time

import anyio
import anyio.lowlevel

from actors.serving.engines import (
    EngineStream,
    KvPages,
    MockEngine,
    MockEngineConfig,
    TimingModel,
    page_content,
)
from benchmarks._common import percentile, report
from protocols.engine import (
    BootstrapInfo,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from protocols.pages import prompt_page_hashes

CONTEXT = 4103  # a 4k-token context with a partial last page
BLOCK = 64
BATCHES = (8, 16)  # the lifecycle benchmark's drain: --quick, and without
_STAGES = ("open", "prepare", "complete", "start")  # of requests landing together


def _request(i: int, tokens: list[int]) -> PreprocessedRequest:
    return PreprocessedRequest(
        rid=f"m{i}",
        token_ids=tokens,
        stop_conditions=StopConditions(max_tokens=50),
        sampling_options=SamplingOptions(temperature=0.0),
        bootstrap_info=BootstrapInfo(host="127.0.0.1", port=7100, room=i),
        live_migration=True,
    )


def _carried(engine: MockEngine, requests: list[PreprocessedRequest]) -> dict[str, int]:
    """The hash of each request's tokens, as a hand-over's pages carry it (the source has it at
    hand: worked out here, outside the measured calls)."""
    return {r.rid: engine._tokens.prefix_hash(r.token_ids) for r in requests}


def _write(engine: MockEngine, pages: KvPages, tokens: list[int]) -> None:
    """Write a received context's pages, as the NIXL WRITE would."""
    memory = engine.kv_buffer(pages.dp_rank)
    for block, h in zip(pages.block_ids, prompt_page_hashes(tokens, BLOCK), strict=True):
        memory[block] = page_content(h, pages.block_bytes)


async def _together(
    engine: MockEngine,
    rng: random.Random,
    batch: int,
    first: int,
    out: dict[str, list[float]] | None,
    *,
    overlap: bool = False,
) -> None:
    """``batch`` live migrations landing together, as a drain's: opened one after another
    (their admissions), prepared in the step loop's one turn, completed in one call (with
    ``overlap``, as the KV bridge does: started, their pages checked in their first step).
    Notes the CPU per request of each stage in ``out``."""
    requests = [
        _request(first + j, [rng.randrange(256) for _ in range(CONTEXT)]) for j in range(batch)
    ]
    hashes = _carried(engine, requests)
    c0 = time.thread_time()
    streams = [engine.generate(r) for r in requests]
    targets = [await engine.wait_transfer_target(r.rid) for r in requests]
    c1 = time.thread_time()
    await anyio.lowlevel.checkpoint()  # the step loop's turn: their expected KV
    c2 = time.thread_time()
    for r, pages in zip(requests, targets, strict=True):
        _write(engine, pages, r.token_ids)
    c3 = time.thread_time()
    verified = engine.complete_transfers(
        [r.rid for r in requests], overlap=overlap, prefix_hashes=hashes if overlap else None
    )
    c4 = time.thread_time()
    if not all(verified.values()):
        raise RuntimeError("the pages did not verify")
    for stream in streams:
        await stream.aclose()
    if out is not None:
        out[f"batch_open{batch}"].append((c1 - c0) / batch)
        out[f"batch_prepare{batch}"].append((c2 - c1) / batch)
        out[f"batch_{'start' if overlap else 'complete'}{batch}"].append((c4 - c3) / batch)


def _config(timing: TimingModel) -> MockEngineConfig:
    return MockEngineConfig(
        role="decode",
        num_blocks=4096,
        block_size=BLOCK,
        kv_bytes_per_block=1024,
        context_length=16384,
        device="cpu",
        timing=timing,
    )


async def first_outputs(rounds: int, batch: int = BATCHES[-1]) -> list[float]:
    """On an idle engine with the default timing model: seconds from ``complete_transfers`` of
    ``batch`` contexts landing together to the last of their first outputs (one decode step:
    a live migration's first token, recomputed, goes out with the one after it), per round."""
    rng = random.Random(11)
    gaps: list[float] = []
    async with MockEngine(_config(TimingModel())) as engine:
        for i in range(rounds + 3):
            requests = [
                _request(i * batch + j, [rng.randrange(256) for _ in range(CONTEXT)])
                for j in range(batch)
            ]
            streams = [engine.generate(r) for r in requests]
            targets = [await engine.wait_transfer_target(r.rid) for r in requests]
            await anyio.sleep(0.01)  # the step loop's turns: their expected KV
            for r, pages in zip(requests, targets, strict=True):
                _write(engine, pages, r.token_ids)
            arrived: list[float] = []

            async def first(stream: EngineStream, arrived: list[float]) -> None:
                await stream.__anext__()
                arrived.append(time.perf_counter())

            hashes = _carried(engine, requests)
            t0 = time.perf_counter()
            started = engine.complete_transfers(
                [r.rid for r in requests], overlap=True, prefix_hashes=hashes
            )
            if not all(started.values()):
                raise RuntimeError("the pages did not verify")
            async with anyio.create_task_group() as tg:
                for stream in streams:
                    tg.start_soon(first, stream, arrived)
            for stream in streams:
                await stream.aclose()
            if i >= 3:  # warm-up
                gaps.append(max(arrived) - t0)
            await anyio.sleep(0.02)  # idle again
    return gaps


async def measure(n: int) -> dict[str, list[float]]:
    config = _config(TimingModel(instant=True))
    rng = random.Random(7)
    out: dict[str, list[float]] = {
        "open_cpu": [],
        "open_wall": [],
        "prepare_cpu": [],
        "cpu": [],
        "wall": [],
        **{f"batch_{stage}{b}": [] for b in BATCHES for stage in _STAGES},
    }
    async with MockEngine(config) as engine:
        for i in range(n + 10):
            tokens = [rng.randrange(256) for _ in range(CONTEXT)]
            request = _request(i, tokens)
            w0, c0 = time.perf_counter(), time.thread_time()
            stream = engine.generate(request)
            pages = await engine.wait_transfer_target(request.rid)
            w1, c1 = time.perf_counter(), time.thread_time()
            await anyio.lowlevel.checkpoint()  # the step loop's turn: the expected KV
            c1p = time.thread_time()
            _write(engine, pages, tokens)
            w2, c2 = time.perf_counter(), time.thread_time()
            if not engine.complete_transfer(request.rid):
                raise RuntimeError("the pages did not verify")
            w3, c3 = time.perf_counter(), time.thread_time()
            await stream.aclose()
            if i >= 10:  # warm-up
                out["open_cpu"].append(c1 - c0)
                out["open_wall"].append(w1 - w0)
                out["prepare_cpu"].append(c1p - c1)
                out["cpu"].append(c3 - c2)
                out["wall"].append(w3 - w2)
        first = n + 10
        for batch in BATCHES:
            for i in range(n // batch + 2):
                for overlap in (False, True):
                    sink = out if i >= 2 else None  # 2 warm-ups
                    await _together(engine, rng, batch, first, sink, overlap=overlap)
                    first += batch
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few seconds")
    args = parser.parse_args()
    got = anyio.run(measure, 100 if args.quick else 400)
    got["first_outputs"] = anyio.run(first_outputs, 15 if args.quick else 40)
    us = {k: [x * 1e6 for x in v] for k, v in got.items()}
    result = {
        "receive_open_cpu_us_p50": round(percentile(us["open_cpu"], 50), 1),
        "receive_prepare_cpu_us_p50": round(percentile(us["prepare_cpu"], 50), 1),
        "receive_complete_cpu_us_p50": round(percentile(us["cpu"], 50), 1),
        "receive_complete_batch_cpu_us_p50": round(percentile(us["batch_complete8"], 50), 1),
    }
    for b in BATCHES:
        for stage in _STAGES:
            result[f"receive_{stage}_batch{b}_cpu_us_p50"] = round(
                percentile(us[f"batch_{stage}{b}"], 50), 1
            )
    rows = [
        ("open, CPU (us, p50)", result["receive_open_cpu_us_p50"], "generate + admission"),
        ("open, wall (us, p50)", round(percentile(us["open_wall"], 50), 1), ""),
        (
            "prepare, CPU (us, p50)",
            result["receive_prepare_cpu_us_p50"],
            "the step loop, KV on its way",
        ),
        ("complete, CPU (us, p50)", result["receive_complete_cpu_us_p50"], "verify + register"),
        ("complete, wall (us, p50)", round(percentile(us["wall"], 50), 1), ""),
    ]
    for b in BATCHES:
        rows += [
            (
                f"{b} together: open, CPU/request (us, p50)",
                result[f"receive_open_batch{b}_cpu_us_p50"],
                "one after another",
            ),
            (
                f"{b} together: prepare, CPU/request (us, p50)",
                result[f"receive_prepare_batch{b}_cpu_us_p50"],
                "one loop turn",
            ),
            (
                f"{b} together: complete, CPU/request (us, p50)",
                result[f"receive_complete_batch{b}_cpu_us_p50"],
                "one complete_transfers call",
            ),
            (
                f"{b} together: start, CPU/request (us, p50)",
                result[f"receive_start_batch{b}_cpu_us_p50"],
                "the same, the check in the step",
            ),
        ]
    result["receive_first_outputs16_ms_p50"] = round(
        percentile([x * 1e3 for x in got["first_outputs"]], 50), 2
    )
    rows.append(
        (
            f"{BATCHES[-1]} together, timed: complete -> first outputs (ms, p50)",
            result["receive_first_outputs16_ms_p50"],
            "one decode step, the check in it",
        )
    )
    report("Live migration, receiving engine, per request (4k context)", rows, result)


if __name__ == "__main__":
    main()
