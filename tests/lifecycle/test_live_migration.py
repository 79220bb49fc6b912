"""Live KV migration on a drain: a draining decode worker's running requests move with their KV
(NIXL, as prefill -> decode) to the other decode worker and continue there with no prefill;
token replay is the fallback when the target has no room or the transfer fails."""

from __future__ import annotations

from typing import Any

import anyio
import httpx

from actors.telemetry import REGISTRY
from protocols import control
from protocols.engine import MemoryTag
from supervisors._lifecycle import DrainWorker, Release, Resume, WorkerStates
from tests.helpers.serving import Tree, serving_tree
from tests.serving.test_disaggregated import DISAGG, _quiet
from tests.serving.test_e2e import _stream_text

# Real time per step, so the drain finds every request mid-generation.
SLOW: dict[str, Any] = {"timing": {"speedup": 1.0}}


def _prompts(n: int, tag: str = "") -> list[str]:
    return [f"live migration {tag}{i}: " + "context " * (i % 7 + 20) for i in range(n)]


def _live(outcome: str) -> float:
    value = REGISTRY.get_sample_value(
        "actorserve_live_migration_total", {"model": "mock", "outcome": outcome}
    )
    return value or 0.0


async def _run(
    client: httpx.AsyncClient, prompts: list[str], max_tokens: int, started: anyio.Event
) -> list[dict[str, Any]]:
    """Stream every prompt; ``started`` is set once each has its first token."""
    results: dict[int, dict[str, Any]] = {}
    first: list[int] = []

    def on_first() -> None:
        first.append(1)
        if len(first) == len(prompts):
            started.set()

    async def one(i: int) -> None:
        results[i] = await _stream_text(client, prompts[i], max_tokens, on_first)

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return [results[i] for i in range(len(prompts))]


async def _drain_running(
    tree: Tree,
    client: httpx.AsyncClient,
    prompts: list[str],
    max_tokens: int,
    drain: Any = None,
) -> tuple[list[dict[str, Any]], dict[str, control.EngineStats]]:
    """Run ``prompts`` all on decode-0 (decode-1 kept out of routing until every one has its
    first token), then drain decode-0 while they generate (or send the lifecycle ``drain``).
    Returns the results, and every worker's statistics from just before the drain."""
    table = tree.serving.table
    out: list[dict[str, Any]] = []
    started = anyio.Event()
    before: dict[str, control.EngineStats] = {}

    async def load() -> None:
        out.extend(await _run(client, prompts, max_tokens, started))

    table.set_draining("decode-1", True)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(load)
            with anyio.fail_after(30):
                await started.wait()
                # A first token comes from the prefill while the KV may still be on its way to
                # decode-0 (seen under a full suite's load: 4 of 16 not yet decoding there, so
                # handed over for replay): wait until decode-0 streams every one.
                while (await tree.engine_stats("decode-0")).streaming < len(prompts):
                    await anyio.sleep(0.01)
            table.set_draining("decode-1", False)
            before.update({w: await tree.engine_stats(w) for w in tree.serving.roles})
            assert before["decode-0"].running == len(prompts)
            await tree.lifecycle.ask(drain or DrainWorker("decode-0"), timeout=None)
    finally:
        table.set_draining("decode-1", False)
    return out, before


async def test_live_migration_of_16_running_requests_needs_no_prefill() -> None:
    prompts = _prompts(16)
    async with serving_tree(**DISAGG, engine_args=SLOW) as tree:
        async with httpx.AsyncClient(base_url=tree.url) as client:
            expected = await _run(client, prompts, 150, anyio.Event())
            await _quiet(tree)
            success, fallback = _live("success"), _live("fallback")
            got, before = await _drain_running(tree, client, prompts, 150)
        await _quiet(tree)
        after = {w: await tree.engine_stats(w) for w in tree.serving.roles}
    assert all(r["error"] is None and r["finish"] == "length" for r in got), got
    assert [r["text"] for r in got] == [r["text"] for r in expected]
    assert [r["usage"] for r in got] == [r["usage"] for r in expected]
    assert after["decode-0"].handovers_live == 16 and after["decode-0"].handovers_replay == 0
    assert (_live("success") - success, _live("fallback") - fallback) == (16, 0)
    # The hand-overs' WRITEs went out from decode-0 (their time, posting to DONE, counted).
    assert after["decode-0"].kv_write_seconds > before["decode-0"].kv_write_seconds
    # No re-prefill anywhere: the target took the KV (the whole context, every token but the
    # last of each request) and computed nothing by prefill; the prefill worker saw nothing new.
    for worker in ("prefill-0", "decode-1"):
        assert after[worker].prefill_tokens == before[worker].prefill_tokens, worker
    received = after["decode-1"].kv_received_tokens - before["decode-1"].kv_received_tokens
    assert received >= sum(len(p) for p in prompts)


async def test_no_room_on_the_target_falls_back_to_replay() -> None:
    # Four slots per worker: decode-1 is full of its own requests when decode-0 drains.
    engine = {**SLOW, "max_running_requests": 4}
    mine, theirs = _prompts(4, "d0-"), _prompts(4, "d1-")
    async with serving_tree(**DISAGG, engine_args=engine) as tree:
        table = tree.serving.table
        async with httpx.AsyncClient(base_url=tree.url) as client:
            expected = await _run(client, mine, 100, anyio.Event())
            await _quiet(tree)
            fallback, success = _live("fallback"), _live("success")
            busy: list[dict[str, Any]] = []
            busy_started = anyio.Event()

            async def keep_decode_1_busy() -> None:
                busy.extend(await _run(client, theirs, 400, busy_started))

            async with anyio.create_task_group() as tg:
                table.set_draining("decode-0", True)
                tg.start_soon(keep_decode_1_busy)
                with anyio.fail_after(30):
                    await busy_started.wait()
                table.set_draining("decode-0", False)
                got, _ = await _drain_running(tree, client, mine, 100)
        await _quiet(tree)
        stats = await tree.engine_stats("decode-0")
    assert all(r["error"] is None and r["finish"] == "length" for r in [*got, *busy]), got
    assert [r["text"] for r in got] == [r["text"] for r in expected]
    assert stats.handovers_live == 4
    assert (_live("fallback") - fallback, _live("success") - success) == (4, 0)


async def test_failed_or_corrupted_transfer_falls_back_to_replay() -> None:
    prompts = _prompts(8)
    async with serving_tree(**DISAGG, engine_args=SLOW) as tree:
        async with httpx.AsyncClient(base_url=tree.url) as client:
            expected = await _run(client, prompts, 150, anyio.Event())
            await _quiet(tree)
            fallback, success = _live("fallback"), _live("success")
            # Of the next KV transfers into decode-1, two fail (as a lost NIXL connection would)
            # and one arrives with a flipped byte (its verification fails).
            await tree.engine("decode-1").ask(control.InjectFault("fail_kv", 2))
            await tree.engine("decode-1").ask(control.InjectFault("corrupt_kv", 1))
            got, before = await _drain_running(tree, client, prompts, 150)
        await _quiet(tree)
        prefill = await tree.engine_stats("prefill-0")
        replayed = prefill.prefill_tokens - before["prefill-0"].prefill_tokens
    assert all(r["error"] is None and r["finish"] == "length" for r in got), got
    assert [r["text"] for r in got] == [r["text"] for r in expected]
    assert (_live("fallback") - fallback, _live("success") - success) == (3, 5)
    assert replayed > 0  # the three fallbacks were prefilled again


async def test_memory_release_moves_the_requests_live() -> None:
    prompts = _prompts(8)
    release = Release(worker="decode-0", tags=(MemoryTag.KV_CACHE, MemoryTag.WEIGHTS))
    async with serving_tree(**DISAGG, engine_args=SLOW) as tree:
        async with httpx.AsyncClient(base_url=tree.url) as client:
            expected = await _run(client, prompts, 150, anyio.Event())
            await _quiet(tree)
            success = _live("success")
            got, _ = await _drain_running(tree, client, prompts, 150, release)
            assert (await tree.lifecycle.ask(WorkerStates()))["decode-0"]["state"] == "released"
            await tree.lifecycle.ask(Resume(worker="decode-0"), timeout=None)
            tree.serving.table.set_draining("decode-1", True)  # decode-0 serves this one
            again = await _stream_text(client, prompts[0], 150)
            tree.serving.table.set_draining("decode-1", False)
        await _quiet(tree)
    assert all(r["error"] is None and r["finish"] == "length" for r in got), got
    assert [r["text"] for r in got] == [r["text"] for r in expected]
    assert _live("success") - success == 8
    assert again["error"] is None and again["text"] == expected[0]["text"]
