"""Pools that change size at run time: a worker added under streaming load serves and fails
nothing; one removed with requests in flight hands them over (live KV migration), none cut; a
pool stays between its minimum and its maximum; a worker whose engine fails to start is not
counted; the control API's route; the tree, the routing table and the metrics follow every
change."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from actors.serving import ServeConfig
from actors.serving.root._control_api import control_app
from actors.serving.root._lifecycle import LifecycleError, WorkerStates
from actors.serving.root._scale import ScaleDown, ScaleRefused, ScaleTo, ScaleUp
from actors.telemetry import REGISTRY
from actors.testing import crash
from supervisors import TreeNode, snapshot_tree
from tests.helpers.serving import Tree, serving_tree
from tests.lifecycle.test_live_migration import _live, _run
from tests.serving.test_disaggregated import _quiet
from tests.serving.test_e2e import _stream_text

SLOW: dict[str, Any] = {"timing": {"speedup": 1.0}}


def _scales(pool: str, direction: str, outcome: str) -> float:
    labels = {"model": "mock", "pool": pool, "direction": direction, "outcome": outcome}
    return REGISTRY.get_sample_value("actorserve_pool_scale_total", labels) or 0.0


def _size(pool: str) -> float | None:
    return REGISTRY.get_sample_value("actorserve_pool_workers", {"model": "mock", "pool": pool})


async def _pool_children(tree: Tree) -> list[str]:
    supervisor = await tree.serving.pool_supervisor(tree.serving.model(), "decode")
    return [c.id for c in await supervisor.which_children()]


def _node(node: TreeNode, *path: str) -> TreeNode:
    for child_id in path:
        (node,) = [c for c in node.children if c.id == child_id]
    return node


def _prompts(n: int, tag: str) -> list[str]:
    return [f"scale {tag} {i}: " + "word " * (i % 5 + 8) for i in range(n)]


async def test_scale_up_under_streaming_load_serves_on_the_new_worker() -> None:
    async with serving_tree(
        mode="aggregated", decode_workers=2, router="round_robin", engine_args=SLOW
    ) as tree:
        prompts, later = _prompts(8, "load"), _prompts(6, "after")
        ups = _scales("decode", "up", "ok")
        async with httpx.AsyncClient(base_url=tree.url) as client:
            expected = await _run(client, prompts + later, 60, anyio.Event())
            got: list[dict[str, Any]] = []
            started = anyio.Event()
            async with anyio.create_task_group() as tg:

                async def load() -> None:
                    got.extend(await _run(client, prompts, 60, started))

                tg.start_soon(load)
                await started.wait()  # every request streams while the pool grows
                result = await tree.lifecycle.ask(ScaleUp("decode"), timeout=None)
            after = await _run(client, later, 60, anyio.Event())
        assert result == {
            "model": "mock",
            "pool": "decode",
            "workers": ["decode-0", "decode-1", "decode-2"],
            "added": ["decode-2"],
            "removed": [],
        }
        assert all(r["error"] is None and r["finish"] == "length" for r in got + after)
        assert [r["text"] for r in got + after] == [r["text"] for r in expected]
        # Round robin over three: the new worker served some of the later requests.
        assert (await tree.engine_stats("decode-2")).finished >= 1
        table = tree.serving.model().table
        assert table.states()["decode-2"] == ("aggregated", "ready")
        assert (await tree.lifecycle.ask(WorkerStates()))["decode-2"]["state"] == "serving"
        assert await _pool_children(tree) == ["decode-0", "decode-1", "decode-2"]
        node = _node(await snapshot_tree(tree.root), "model:mock", "decode-pool", "decode-2")
        assert (node.kind, node.state) == ("supervisor", "running")
        assert [c.id for c in node.children] == ["engine", "publisher", "health"]
        assert _scales("decode", "up", "ok") == ups + 1
        assert _size("decode") == 3


async def test_scale_down_with_requests_in_flight_cuts_no_stream() -> None:
    disagg = {"mode": "disaggregated", "prefill_workers": 1, "decode_workers": 3}
    async with serving_tree(**disagg, router="round_robin", engine_args=SLOW) as tree:
        table = tree.serving.model().table
        prompts = _prompts(12, "down")
        downs, live = _scales("decode", "down", "ok"), _live("success")
        async with httpx.AsyncClient(base_url=tree.url) as client:
            expected = await _run(client, prompts, 120, anyio.Event())
            await _quiet(tree)
            got: list[dict[str, Any]] = []
            started = anyio.Event()
            async with anyio.create_task_group() as tg:

                async def load() -> None:
                    got.extend(await _run(client, prompts, 120, started))

                tg.start_soon(load)
                with anyio.fail_after(30):
                    await started.wait()
                    while (await tree.engine_stats("decode-2")).streaming < 1:
                        await anyio.sleep(0.01)
                # The newest worker goes: decode-2, with requests decoding on it.
                result = await tree.lifecycle.ask(ScaleDown("decode"), timeout=None)
        assert result["removed"] == ["decode-2"]
        assert result["workers"] == ["decode-0", "decode-1"]
        assert all(r["error"] is None and r["finish"] == "length" for r in got), got
        assert [r["text"] for r in got] == [r["text"] for r in expected]
        assert _live("success") > live  # its requests moved with their KV
        assert "decode-2" not in table.states() and "decode-2" not in table.workers
        assert await _pool_children(tree) == ["decode-0", "decode-1"]
        tree_now = await snapshot_tree(tree.root)
        pool = _node(tree_now, "model:mock", "decode-pool")
        assert [c.id for c in pool.children] == ["decode-0", "decode-1"]
        assert _scales("decode", "down", "ok") == downs + 1
        assert _size("decode") == 2


@pytest.mark.parametrize(
    ("bounds", "message"),
    [
        ({"min_decode_workers": 0}, "at least 1"),
        ({"min_decode_workers": 3}, "at most the pool's starting size"),
        ({"max_decode_workers": 1}, r"max_decode_workers \(1\) must be at least"),
        ({"mode": "disaggregated", "max_prefill_workers": 0}, "max_prefill_workers"),
    ],
)
def test_bounds_outside_the_starting_size_are_refused(bounds: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServeConfig(backend="mock", decode_workers=2, **bounds)


async def test_a_pool_stays_between_its_minimum_and_its_maximum() -> None:
    async with serving_tree(
        mode="aggregated", decode_workers=2, min_decode_workers=2, max_decode_workers=3
    ) as tree:
        refused = _scales("decode", "down", "refused")
        refused_up = _scales("decode", "up", "refused")
        # Up by two would pass the maximum: refused whole, nothing started.
        with pytest.raises(ScaleRefused, match="may not go above 3"):
            await tree.lifecycle.ask(ScaleUp("decode", 2), timeout=None)
        with pytest.raises(ScaleRefused, match="may not go above 3"):
            await tree.lifecycle.ask(ScaleTo("decode", 4), timeout=None)
        assert _scales("decode", "up", "refused") == refused_up + 2
        assert list(tree.serving.model().roles) == ["decode-0", "decode-1"]
        with pytest.raises(ScaleRefused, match="may not go below 2"):
            await tree.lifecycle.ask(ScaleDown("decode"), timeout=None)
        with pytest.raises(ScaleRefused, match="may not go below 2"):
            await tree.lifecycle.ask(ScaleTo("decode", 1), timeout=None)
        with pytest.raises(ScaleRefused, match="no 'prefill' pool"):
            await tree.lifecycle.ask(ScaleUp("prefill"), timeout=None)
        await tree.lifecycle.ask(ScaleUp("decode"), timeout=None)
        with pytest.raises(ScaleRefused, match="may not go above 3"):
            await tree.lifecycle.ask(ScaleUp("decode"), timeout=None)
        with pytest.raises(ScaleRefused, match="'ghost' is no worker of the decode pool"):
            await tree.lifecycle.ask(ScaleDown("decode", "ghost"), timeout=None)
        # Down to its minimum by name, and no further.
        done = await tree.lifecycle.ask(ScaleDown("decode", "decode-0"), timeout=None)
        assert done["workers"] == ["decode-1", "decode-2"]
        with pytest.raises(ScaleRefused):
            await tree.lifecycle.ask(ScaleDown("decode"), timeout=None)
        assert _scales("decode", "down", "refused") == refused + 4
        assert tree.serving.routable() == 2
        async with httpx.AsyncClient(base_url=tree.url) as client:
            assert (await _stream_text(client, "still serving", 4))["error"] is None


async def test_a_worker_that_fails_to_start_is_not_counted(tmp_path: Path) -> None:
    fail_file = str(tmp_path / "fail-starts-{worker}")
    async with serving_tree(
        mode="aggregated", decode_workers=2, engine_args={"fail_start_file": fail_file}
    ) as tree:
        await anyio.Path(fail_file.replace("{worker}", "decode-2")).write_text("1")
        failed = _scales("decode", "up", "failed")
        with pytest.raises(LifecycleError, match="adding 'decode-2' to the decode pool failed"):
            await tree.lifecycle.ask(ScaleUp("decode"), timeout=None)
        assert _scales("decode", "up", "failed") == failed + 1
        assert list(tree.serving.model().roles) == ["decode-0", "decode-1"]
        assert await _pool_children(tree) == ["decode-0", "decode-1"]
        assert _size("decode") == 2
        # The pool is as it was: the next scale-up (its engine starts now) takes the same id.
        result = await tree.lifecycle.ask(ScaleUp("decode"), timeout=None)
        assert result["added"] == ["decode-2"]
        assert tree.serving.routable() == 3


async def test_a_pool_that_restarts_keeps_its_scaled_size() -> None:
    async with serving_tree(mode="aggregated", decode_workers=1) as tree:
        await tree.lifecycle.ask(ScaleUp("decode", 2), timeout=None)
        pool = await tree.serving.pool_supervisor(tree.serving.model(), "decode")
        await crash(pool.ref)  # the model's supervisor starts the pool again, as it is now
        await tree.wait_ready(3)
        assert await _pool_children(tree) == ["decode-0", "decode-1", "decode-2"]


async def test_the_control_api_scales_a_pool() -> None:
    async with serving_tree(mode="aggregated", decode_workers=1) as tree:
        app = control_app(tree.lifecycle, "s3cret", lambda: None)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://control") as client:
            body = {"pool": "decode", "delta": 1}
            assert (await client.post("/control/scale", json=body)).status_code == 401
            auth = {"authorization": "Bearer s3cret"}

            async def scale(**fields: Any) -> httpx.Response:
                return await client.post("/control/scale", headers=auth, json=fields)

            up = await scale(pool="decode", delta=2)
            assert up.status_code == 200, up.text
            assert up.json()["result"]["added"] == ["decode-1", "decode-2"]
            down = await scale(pool="decode", delta=-1, worker="decode-1")
            assert down.status_code == 200, down.text
            assert down.json()["result"]["workers"] == ["decode-0", "decode-2"]
            to = await scale(pool="decode", to=1)
            assert to.json()["result"] == {
                "model": "mock",
                "pool": "decode",
                "workers": ["decode-0"],
                "added": [],
                "removed": ["decode-2"],
            }
            refused = await scale(pool="decode", delta=-1)
            assert refused.status_code == 409
            assert "may not go below 1" in refused.json()["error"]["message"]
            for bad in (
                {"pool": "decode"},
                {"pool": "decode", "delta": 1, "to": 2},
                {"pool": "decode", "delta": 0},
                {"pool": "decode", "delta": True},
                {"pool": "decode", "delta": 1, "worker": "decode-0"},
                {"delta": 1},
            ):
                assert (await scale(**bad)).status_code == 400, bad
        assert tree.serving.routable() == 1
