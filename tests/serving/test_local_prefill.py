"""Conditional disaggregation: a decode worker prefills a request itself when the uncached part of
its prompt is short or the prefill workers' queue is long, and gives the same text."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest
from typer.testing import CliRunner

from actors.serving import ServeConfig, cli
from actors.serving.root import load_config
from actors.telemetry import REGISTRY
from actors.testing import wait_until
from protocols import control
from protocols.engine import PauseMode
from tests.helpers.serving import Tree, serving_tree
from tests.serving.test_e2e import _stream_text

# No canary while a test reads the prefill engine's counters (they prefill too).
DISAGG: dict[str, Any] = {
    "mode": "disaggregated",
    "prefill_workers": 1,
    "decode_workers": 1,
    "health_idle_after": 600.0,
}
SHORT = "a short prompt"
LONG = "a prompt well over the local prefill threshold, " * 8


def _decisions(decision: str, reason: str) -> float:
    """Disaggregated attempts of the mock model prefilled ``decision`` for ``reason`` so far."""
    return sum(
        sample.value
        for metric in REGISTRY.collect()
        if metric.name == "actorserve_frontend_prefill_decision"
        for sample in metric.samples
        if sample.name.endswith("_total")
        and sample.labels == {"model": "mock", "decision": decision, "reason": reason}
    )


async def _prefilled(tree: Tree) -> int:
    return (await tree.engine_stats("prefill-0")).prefill_tokens


async def _prefill_running(tree: Tree) -> bool:
    return (await tree.engine_stats("prefill-0")).running >= 1


async def test_short_prompts_prefill_on_the_decode_worker_long_ones_remotely() -> None:
    async with serving_tree(**DISAGG) as off, httpx.AsyncClient(base_url=off.url) as client:
        remote = _decisions("remote", "off")
        before = await _prefilled(off)
        expected = [await _stream_text(client, p, 16) for p in (SHORT, LONG)]
        # Local prefill off: both went to the prefill worker, as before.
        assert _decisions("remote", "off") == remote + 2
        assert await _prefilled(off) > before
    async with (
        serving_tree(**DISAGG, local_prefill_max_tokens=64) as tree,
        httpx.AsyncClient(base_url=tree.url) as client,
    ):
        short, long = _decisions("local", "short_prompt"), _decisions("remote", "long_prompt")
        before = await _prefilled(tree)
        got = [await _stream_text(client, SHORT, 16)]
        assert await _prefilled(tree) == before
        assert _decisions("local", "short_prompt") == short + 1
        got.append(await _stream_text(client, LONG, 16))
        assert await _prefilled(tree) > before
        assert _decisions("remote", "long_prompt") == long + 1
        # The decode worker now holds the long prompt's pages (received from the prefill): the
        # part it would still compute is short.
        table, tokens = tree.serving.model().table, tree.serving.model().tokenizer.encode(LONG)
        await wait_until(lambda: table.overlap("decode-0", tokens) > 0)
        before = await _prefilled(tree)
        again = await _stream_text(client, LONG, 16)
        assert await _prefilled(tree) == before
        assert _decisions("local", "short_prompt") == short + 2
    assert all(r["error"] is None for r in [*got, again]), [*got, again]
    assert [r["text"] for r in got] == [r["text"] for r in expected]
    assert again["text"] == expected[1]["text"]


async def test_a_long_prefill_queue_sends_the_request_to_the_decode_worker() -> None:
    async with (
        serving_tree(**DISAGG, local_prefill_max_tokens=1, local_prefill_queue=1) as tree,
        httpx.AsyncClient(base_url=tree.url) as client,
    ):
        prefill = tree.engine("prefill-0")
        # The prefill worker takes requests but runs none: the first one waits in its queue.
        await prefill.ask(control.Pause(PauseMode.IN_PLACE))
        queued, remote = _decisions("local", "prefill_queue"), _decisions("remote", "long_prompt")
        results: list[dict[str, Any]] = []
        async with anyio.create_task_group() as tg:

            async def held() -> None:
                results.append(await _stream_text(client, LONG, 16))

            tg.start_soon(held)
            await wait_until(lambda: _decisions("remote", "long_prompt") == remote + 1)
            await wait_until(lambda: _prefill_running(tree))
            local = await _stream_text(client, LONG, 16)
            assert _decisions("local", "prefill_queue") == queued + 1
            await prefill.ask(control.ContinueGeneration())
    assert local["error"] is None and results[0]["error"] is None, (local, results)
    assert local["text"] == results[0]["text"]


async def test_a_decode_engine_that_cannot_prefill_alone_always_waits_for_a_prefill() -> None:
    engine = {"prefills_alone": False}
    async with (
        serving_tree(**DISAGG, local_prefill_max_tokens=64, engine_args=engine) as tree,
        httpx.AsyncClient(base_url=tree.url) as client,
    ):
        remote = _decisions("remote", "decode_cannot_prefill")
        before = await _prefilled(tree)
        result = await _stream_text(client, SHORT, 8)
        assert result["error"] is None, result
        assert await _prefilled(tree) > before
        assert _decisions("remote", "decode_cannot_prefill") == remote + 1


@pytest.mark.parametrize("field", ["local_prefill_max_tokens", "local_prefill_queue"])
def test_negative_thresholds_are_refused(field: str) -> None:
    with pytest.raises(ValueError, match=f"{field} must be >= 0"):
        ServeConfig(backend="mock", **{field: -1})
    with pytest.raises(ValueError, match=f"{field} must be >= 0"):
        load_config(None, {"backend": "mock", field: -1})
    flag = "--" + field.replace("_", "-")
    result = CliRunner().invoke(cli.app, ["run", "--backend", "mock", flag, "-1"])
    assert result.exit_code == 2
    assert f"{field} must be >= 0" in " ".join(result.output.split())


def test_the_thresholds_are_plain_config_off_by_default() -> None:
    cfg = load_config(None, {"backend": "mock", "local_prefill_max_tokens": 256})
    assert (cfg.local_prefill_max_tokens, cfg.local_prefill_queue) == (256, 4)
    assert ServeConfig(backend="mock").local_prefill_max_tokens == 0  # off by default
