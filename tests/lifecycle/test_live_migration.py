"""Live KV migration on a drain: a draining decode worker's running requests move with their KV
(NIXL, as prefill -> decode) to the other decode worker and continue there with no prefill;
token replay is the fallback when the target has no room or the transfer fails."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import httpx
import pytest

from actors.serving.root._lifecycle import (
    DrainWorker,
    LifecycleError,
    Release,
    Resume,
    WorkerStates,
)
from actors.telemetry import REGISTRY
from protocols import control
from protocols.engine import MemoryTag
from tests.helpers.serving import Tree, serving_tree
from tests.serving.test_disaggregated import DISAGG, _quiet
from tests.serving.test_e2e import _stream_text

# Real time per step, so the drain finds every request mid-generation.
SLOW: dict[str, Any] = {"timing": {"speedup": 1.0}}


def _prompts(n: int, tag: str = "") -> list[str]:
    return [f"live migration {tag}{i}: " + "context " * (i % 7 + 20) for i in range(n)]


def _live(outcome: str) -> float:
    value = REGISTRY.get_sample_value(
        "actorserve_frontend_model_live_migration_total", {"model": "mock", "outcome": outcome}
    )
    return value or 0.0


def _ahead(outcome: str = "taken") -> float:
    value = REGISTRY.get_sample_value(
        "actorserve_frontend_model_live_migration_ahead_total",
        {"model": "mock", "outcome": outcome},
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
    raises: type[BaseException] | None = None,
    before_drain: Callable[[], Awaitable[None]] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, control.EngineStats]]:
    """Run ``prompts`` all on decode-0 (decode-1 kept out of routing until every one has its
    first token), then drain decode-0 while they generate (or send the lifecycle ``drain``,
    which must raise ``raises`` if given; ``before_drain`` is awaited first). Returns the
    results, and every worker's statistics from just before the drain."""
    table = tree.serving.model().table
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
            if before_drain is not None:
                await before_drain()
            with pytest.raises(raises) if raises else contextlib.nullcontext():
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
            success, fallback, ahead = _live("success"), _live("fallback"), _ahead()
            got, before = await _drain_running(tree, client, prompts, 150)
        await _quiet(tree)
        after = {w: await tree.engine_stats(w) for w in tree.serving.roles}
    assert all(r["error"] is None and r["finish"] == "length" for r in got), got
    assert [r["text"] for r in got] == [r["text"] for r in expected]
    assert [r["usage"] for r in got] == [r["usage"] for r in expected]
    assert after["decode-0"].handovers_live == 16 and after["decode-0"].handovers_replay == 0
    assert (_live("success") - success, _live("fallback") - fallback) == (16, 0)
    # Each was sent to decode-1 (which asked for its KV) while decode-0's last step still ran.
    assert _ahead() - ahead == 16
    # The hand-overs' WRITEs went out from decode-0 (their time, posting to DONE, counted).
    assert after["decode-0"].kv_write_seconds > before["decode-0"].kv_write_seconds
    # No re-prefill anywhere: the target took the KV (the whole context, every token but the
    # last of each request) and computed nothing by prefill; the prefill worker saw nothing new.
    for worker in ("prefill-0", "decode-1"):
        assert after[worker].prefill_tokens == before[worker].prefill_tokens, worker
    received = after["decode-1"].kv_received_tokens - before["decode-1"].kv_received_tokens
    assert received >= sum(len(p) for p in prompts)


async def test_a_request_that_ends_at_the_drains_boundary_stays() -> None:
    # Steps of ~0.1 s: the drain comes while decode-0 runs the step of the request's last
    # token. It was offered (decode-1 got its continuation and asked for its KV), then ended
    # in that step: it finishes on decode-0, decode-1 lets its reservation go, and nothing is
    # left on any worker.
    prompt, max_tokens = _prompts(1)[0], 12
    async with serving_tree(**DISAGG, engine_args={"timing": {"speedup": 0.1}}) as tree:
        table = tree.serving.model().table
        async with httpx.AsyncClient(base_url=tree.url) as client:
            expected = await _stream_text(client, prompt, max_tokens)
            await _quiet(tree)
            before = await tree.engine_stats("decode-1")
            taken, dropped = _ahead("taken"), _ahead("dropped")
            last_step = anyio.Event()

            def on_chunk(n: int) -> None:
                table.set_draining("decode-1", False)
                if n == max_tokens - 1:
                    last_step.set()

            table.set_draining("decode-1", True)  # the request decodes on decode-0
            async with anyio.create_task_group() as tg:

                async def run() -> None:
                    got.update(await _stream_text(client, prompt, max_tokens, on_chunk=on_chunk))

                got: dict[str, Any] = {}
                tg.start_soon(run)
                await last_step.wait()
                await tree.lifecycle.ask(DrainWorker("decode-0"), timeout=None)
        await _quiet(tree)
        stats = {w: await tree.engine_stats(w) for w in ("decode-0", "decode-1")}
    assert got["error"] is None and got["finish"] == "length"
    assert (got["text"], got["usage"]) == (expected["text"], expected["usage"])
    assert (_ahead("taken") - taken, _ahead("dropped") - dropped) == (0, 1)
    assert (stats["decode-0"].handovers_live, stats["decode-0"].handovers_replay) == (0, 0)
    # decode-1 reserved pages for the KV, received none and computed nothing.
    after = stats["decode-1"]
    assert after.kv_received_tokens == before.kv_received_tokens
    assert after.prefill_tokens == before.prefill_tokens


async def test_a_draining_worker_killed_before_its_boundary_loses_nothing() -> None:
    # decode-0's steps are made 1000 times slower before the drain, so the drain finds one of
    # ~100 s in flight: it is killed once it offered its requests (decode-1 has each one's
    # continuation, waiting for KV that will never come), long before that step's boundary.
    # Each request is replayed from its tokens instead, and decode-1's reservations are dropped.
    prompts = _prompts(4)
    async with serving_tree(**DISAGG, engine_args={"timing": {"speedup": 0.1}}) as tree:
        async with httpx.AsyncClient(base_url=tree.url) as client:
            expected = await _run(client, prompts, 20, anyio.Event())
            await _quiet(tree)
            taken, dropped, success = _ahead("taken"), _ahead("dropped"), _live("success")
            victim = (await tree.engine_stats("decode-0")).pid

            async def kill_once_offered() -> None:
                with anyio.fail_after(30):
                    while (await tree.engine_stats("decode-1")).running < len(prompts):
                        await anyio.sleep(0.005)
                os.kill(victim, signal.SIGKILL)

            async def slow_down() -> None:
                await tree.engine("decode-0").ask(control.Perturb("slow", 1000.0))
                await anyio.sleep(0.5)  # the step in flight then is a slow one

            lifecycle = tree.lifecycle
            async with anyio.create_task_group() as tg:
                tg.start_soon(kill_once_offered)
                # The drain fails with the worker, a typed error; the lifecycle actor goes on.
                got, _ = await _drain_running(
                    tree, client, prompts, 20, raises=LifecycleError, before_drain=slow_down
                )
            assert isinstance(await lifecycle.ask(WorkerStates()), dict)
            await tree.wait_ready()
        await _quiet(tree)
    assert all(r["error"] is None and r["finish"] == "length" for r in got), got
    assert [r["text"] for r in got] == [r["text"] for r in expected]
    assert (_ahead("taken") - taken, _ahead("dropped") - dropped) == (0, len(prompts))
    assert _live("success") == success


async def test_no_room_on_the_target_falls_back_to_replay() -> None:
    # Four slots per worker: decode-1 is full of its own requests when decode-0 drains.
    engine = {**SLOW, "max_running_requests": 4}
    mine, theirs = _prompts(4, "d0-"), _prompts(4, "d1-")
    async with serving_tree(**DISAGG, engine_args=engine) as tree:
        table = tree.serving.model().table
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
            tree.serving.model().table.set_draining("decode-1", True)  # decode-0 serves this one
            again = await _stream_text(client, prompts[0], 150)
            tree.serving.model().table.set_draining("decode-1", False)
        await _quiet(tree)
    assert all(r["error"] is None and r["finish"] == "length" for r in got), got
    assert [r["text"] for r in got] == [r["text"] for r in expected]
    assert _live("success") - success == 8
    assert again["error"] is None and again["text"] == expected[0]["text"]
