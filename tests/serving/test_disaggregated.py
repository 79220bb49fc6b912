"""Disaggregated serving: prefill and decode workers in their own processes, KV over NIXL."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from actors.telemetry import REGISTRY
from actors.testing import wait_until
from protocols import control
from tests.helpers.serving import Tree, serving_tree
from tests.serving.test_e2e import _stream_text

DISAGG: dict[str, Any] = {"mode": "disaggregated", "prefill_workers": 1, "decode_workers": 2}


async def _run_all(
    client: httpx.AsyncClient, prompts: list[str], max_tokens: int
) -> list[dict[str, Any]]:
    results: dict[int, dict[str, Any]] = {}

    async def one(i: int) -> None:
        results[i] = await _stream_text(client, prompts[i], max_tokens)

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return [results[i] for i in range(len(prompts))]


def _fallbacks() -> float:
    """Requests served by a decode worker alone so far."""
    return sum(
        sample.value
        for metric in REGISTRY.collect()
        if metric.name == "actorserve_frontend_decode_only_fallback"
        for sample in metric.samples
        if sample.name.endswith("_total")
    )


async def _quiet(tree: Tree) -> None:
    """No request, page, transfer page or live hand-over left on any worker."""
    with anyio.fail_after(15):
        for worker in tree.serving.roles:
            while True:
                s = await tree.engine_stats(worker)
                idle = s.engine_in_flight == 0 and s.kv_used_blocks == 0 and s.quiescent
                if idle and s.transfer_pages == 0 and s.handovers_open == 0:
                    break
                await anyio.sleep(0.02)


PROMPTS = [f"disaggregated request {i}: " + "context " * (i % 5 + 3) for i in range(16)]


async def test_disaggregated_output_equals_aggregated() -> None:
    async with serving_tree(mode="aggregated", decode_workers=1) as agg:
        async with httpx.AsyncClient(base_url=agg.url) as client:
            expected = await _run_all(client, PROMPTS, 24)
    async with serving_tree(**DISAGG) as tree:
        async with httpx.AsyncClient(base_url=tree.url) as client:
            got = await _run_all(client, PROMPTS, 24)
        await _quiet(tree)
        # The prompts' pages went prefill -> decode: both decode workers received some.
        assert all(r["error"] is None for r in got), [r["error"] for r in got]
    assert [r["text"] for r in got] == [r["text"] for r in expected]


async def test_corrupted_page_is_caught_and_the_request_migrates() -> None:
    async with serving_tree(**DISAGG, router="round_robin") as tree:
        for worker in ("decode-0", "decode-1"):
            await tree.engine(worker).ask(control.InjectFault("corrupt_kv"))
        async with httpx.AsyncClient(base_url=tree.url) as client:
            results = await _run_all(client, PROMPTS[:4], 12)
        assert all(r["error"] is None and r["finish"] == "length" for r in results), results
        await _quiet(tree)


async def test_kill_decode_mid_stream_and_prefill_mid_transfer() -> None:
    engine = {"timing": {"speedup": 1.0}}
    async with serving_tree(**DISAGG, engine_args=engine) as tree:
        async with httpx.AsyncClient(base_url=tree.url) as client:
            expected = await _run_all(client, PROMPTS[:8], 60)
            for victim in ("decode-0", "prefill-0"):
                results: list[dict[str, Any]] = []

                async def load(into: list[dict[str, Any]] = results) -> None:
                    into.extend(await _run_all(client, PROMPTS[:8], 60))

                async with anyio.create_task_group() as tg:
                    tg.start_soon(load)
                    # All eight admitted first: with its only prefill worker down the model
                    # takes no new request (503), and the test is about those in flight.
                    with anyio.fail_after(20):
                        while (
                            tree.serving.admission.inflight < 8
                            or (await tree.engine_stats(victim)).running < 1
                        ):
                            await anyio.sleep(0.005)
                    os.kill((await tree.engine_stats(victim)).pid, signal.SIGKILL)
                assert all(r["error"] is None for r in results), [r["error"] for r in results]
                assert [r["text"] for r in results] == [r["text"] for r in expected]
                await tree.wait_ready()
        await _quiet(tree)


async def test_client_cancel_during_transfer_frees_both_sides() -> None:
    engine = {"timing": {"speedup": 0.5}}
    async with serving_tree(**DISAGG, engine_args=engine) as tree:
        async with httpx.AsyncClient(base_url=tree.url) as client:
            with anyio.move_on_after(0.3):
                await _stream_text(client, "a long prompt " * 100, 200)
        await _quiet(tree)


@pytest.mark.parametrize(("prefill_workers", "prefills_alone"), [(1, True), (2, True), (1, False)])
async def test_prefill_killed_while_decode_waits_for_its_kv(
    prefill_workers: int, prefills_alone: bool, tmp_path: Path
) -> None:
    prompt = "a prompt whose prefill dies during its KV handshake " * 3
    # The request's deadline is far below decode's own KV receive timeout: it must move on
    # when its prefill dies, not when decode gives up waiting. Decode engines that cannot
    # prefill alone (SGLang's) make it wait for the prefill worker's restart instead of falling
    # back to decode only.
    fail_file = str(tmp_path / "fail-starts-{worker}")
    async with serving_tree(
        mode="disaggregated",
        prefill_workers=prefill_workers,
        decode_workers=2,
        request_timeout=20.0,
        engine_args={"prefills_alone": prefills_alone, "fail_start_file": fail_file},
    ) as tree:
        table = tree.serving.model().table
        tokens = tree.serving.model().tokenizer.encode(prompt)
        prefills = [w for w, role in tree.serving.roles.items() if role == "prefill"]
        decodes = [w for w, role in tree.serving.roles.items() if role == "decode"]

        async def received() -> int:
            return sum([(await tree.engine_stats(w)).kv_received_tokens for w in decodes])

        async with httpx.AsyncClient(base_url=tree.url) as client:
            expected = await _stream_text(client, prompt, 40)
            # The prefill that cached the prompt gets it again (kv_aware routing).
            await wait_until(lambda: any(table.overlap(w, tokens) for w in prefills))
            victim = next(w for w in prefills if table.overlap(w, tokens))
            victim_pid = (await tree.engine_stats(victim)).pid
            received_before = await received()
            # Its next prefill never sends the KV: decode waits in the handshake until it dies.
            await tree.engine(victim).ask(control.InjectFault("hold_kv"))
            result: dict[str, Any] = {}

            async def one() -> None:
                result.update(await _stream_text(client, prompt, 40))

            async def in_handshake() -> bool:
                # The prefill streamed its token and holds the KV; a decode worker's pages
                # wait for it.
                if (await tree.engine_stats(victim)).streaming < 1:
                    return False
                return any([(await tree.engine_stats(w)).transfer_pages > 0 for w in decodes])

            fallbacks = _fallbacks()
            if not prefills_alone:
                # Its next starts fail: the retry finds no prefill worker routable for a while.
                await anyio.Path(fail_file.replace("{worker}", victim)).write_text("2")
            async with anyio.create_task_group() as tg:
                tg.start_soon(one)
                await wait_until(in_handshake)
                os.kill(victim_pid, signal.SIGKILL)
        assert result["error"] is None, result["error"]
        if not prefills_alone:
            assert _fallbacks() == fallbacks
        assert (result["text"], result["finish"]) == (expected["text"], expected["finish"])
        assert result["usage"]["completion_tokens"] == 40
        if prefill_workers > 1:
            # Prefilled again on the live prefill worker: its KV reached a decode worker.
            assert await received() > received_before
        await tree.wait_ready()
        assert (await tree.engine_stats(victim)).pid != victim_pid
        await _quiet(tree)
