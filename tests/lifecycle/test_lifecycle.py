"""Ordered lifecycles: drain with hand-over, memory release/resume, rolling release, rollback,
the control API, and the root's staged shutdown on SIGTERM (on its default loop, uvloop where
installed; the scenarios run it on asyncio and trio)."""

from __future__ import annotations

import signal
import subprocess
import time
from typing import Any

import anyio
import httpx
import psutil
import pytest
from typer.testing import CliRunner

from actors._net import free_port
from actors.serving.cli import app
from actors.serving.root._control_api import control_app
from actors.serving.root._lifecycle import (
    DrainWorker,
    LifecycleError,
    Release,
    Resume,
    UndrainWorker,
    WorkerStates,
)
from actors.serving.root._root import wait_healthy
from actors.serving.worker._health import CANARIES
from actors.testing import wait_until
from protocols import control
from protocols.engine import MemoryTag
from tests.helpers.serving import serving_tree, start_root
from tests.serving.test_e2e import _stream_text

BIG_WEIGHTS = {"weights_bytes": 96 << 20}


def _rss(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


async def _load(
    client: httpx.AsyncClient,
    n: int,
    results: list[dict[str, Any]],
    max_tokens: int = 80,
    started: list[int] | None = None,
) -> None:
    def first() -> None:
        if started is not None:
            started.append(1)

    async with anyio.create_task_group() as tg:
        for i in range(n):

            async def one(i: int = i) -> None:
                results.append(await _stream_text(client, f"load {i} please", max_tokens, first))

            tg.start_soon(one)


async def test_drain_hands_requests_over_without_failures() -> None:
    async with serving_tree(
        mode="aggregated", decode_workers=2, engine_args={"timing": {"speedup": 1.0}}
    ) as tree:
        async with httpx.AsyncClient(base_url=tree.url) as client:
            baseline: list[dict[str, Any]] = []
            await _load(client, 8, baseline)
            results: list[dict[str, Any]] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(_load, client, 8, results)
                with anyio.fail_after(20):
                    while (await tree.engine_stats("decode-0")).running < 1:
                        await anyio.sleep(0.01)
                await tree.lifecycle.ask(DrainWorker("decode-0"), timeout=None)
                assert not tree.serving.model().table.workers["decode-0"].routable
            assert all(r["error"] is None and r["finish"] == "length" for r in results)
            assert sorted(r["text"] for r in results) == sorted(r["text"] for r in baseline)
            stats = await tree.engine_stats("decode-0")
            assert stats.running == 0 and not stats.admitting


async def test_release_and_resume_under_load_frees_memory_and_fails_nothing() -> None:
    engine_args = {"timing": {"speedup": 2.0}, **BIG_WEIGHTS}
    async with serving_tree(mode="aggregated", decode_workers=2, engine_args=engine_args) as tree:
        pid = (await tree.engine_stats("decode-0")).pid
        before = _rss(pid)
        async with httpx.AsyncClient(base_url=tree.url) as client:
            results: list[dict[str, Any]] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(_load, client, 16, results)
                await anyio.sleep(0.2)
                await tree.lifecycle.ask(
                    Release(worker="decode-0", tags=(MemoryTag.WEIGHTS, MemoryTag.KV_CACHE)),
                    timeout=None,
                )
                released = _rss(pid)
                states = await tree.lifecycle.ask(WorkerStates())
                assert states["decode-0"]["state"] == "released"
                assert not tree.serving.model().table.workers["decode-0"].routable
                # Idempotent: a second release of the same tags is an ok no-op.
                await tree.lifecycle.ask(
                    Release(worker="decode-0", tags=(MemoryTag.WEIGHTS,)), timeout=None
                )
                await tree.lifecycle.ask(Resume(worker="decode-0"), timeout=None)
                restored = _rss(pid)
            assert all(r["error"] is None and r["finish"] == "length" for r in results), results
            assert len(results) == 16
        assert before - released > 64 << 20, (before, released)
        assert restored - released > 64 << 20, (released, restored)
        assert tree.serving.model().table.workers["decode-0"].routable
        # Resume without a release is an ok no-op.
        await tree.lifecycle.ask(Resume(worker="decode-0"), timeout=None)


def _canaries(worker: str, outcome: str) -> float:
    return sum(
        s.value
        for s in next(iter(CANARIES.collect())).samples
        if s.name.endswith("_total") and s.labels == {"worker": worker, "outcome": outcome}
    )


async def test_a_worker_held_out_of_service_is_not_failed_by_its_health_checks() -> None:
    # Canaries every 0.2 s idle, failed after two: a drain or a release held for seconds would
    # fail a worker whose checker canaried it anyway (and restart it under its operator).
    async with serving_tree(
        mode="aggregated", decode_workers=2, health_idle_after=0.2, health_failures=2
    ) as tree:
        pid = (await tree.engine_stats("decode-0")).pid
        failed = _canaries("decode-0", "error") + _canaries("decode-0", "timeout")
        await tree.lifecycle.ask(DrainWorker("decode-0"), timeout=None)
        await anyio.sleep(2.0)  # many check intervals out of service
        await tree.lifecycle.ask(UndrainWorker("decode-0"), timeout=None)
        await tree.lifecycle.ask(
            Release(worker="decode-0", tags=(MemoryTag.WEIGHTS, MemoryTag.KV_CACHE)), timeout=None
        )
        await anyio.sleep(2.0)
        await tree.lifecycle.ask(Resume(worker="decode-0"), timeout=None)
        assert (await tree.engine_stats("decode-0")).pid == pid
        assert _canaries("decode-0", "error") + _canaries("decode-0", "timeout") == failed
        assert tree.serving.model().table.workers["decode-0"].routable
        # Back in service, it is checked again, and passes.
        passed = _canaries("decode-0", "ok")
        await wait_until(lambda: _canaries("decode-0", "ok") > passed)


async def test_partial_resume_keeps_the_worker_out_of_routing() -> None:
    async with serving_tree(mode="aggregated", decode_workers=2) as tree:
        lifecycle = tree.lifecycle
        await lifecycle.ask(
            Release(worker="decode-1", tags=(MemoryTag.WEIGHTS, MemoryTag.KV_CACHE)), timeout=None
        )
        await lifecycle.ask(Resume(worker="decode-1", tags=(MemoryTag.WEIGHTS,)), timeout=None)
        states = await lifecycle.ask(WorkerStates())
        assert states["decode-1"]["released"] == ["kv_cache"]
        assert not tree.serving.model().table.workers["decode-1"].routable
        await lifecycle.ask(Resume(worker="decode-1", tags=(MemoryTag.KV_CACHE,)), timeout=None)
        assert tree.serving.model().table.workers["decode-1"].routable
        assert (await lifecycle.ask(WorkerStates()))["decode-1"]["state"] == "serving"


async def test_failed_release_rolls_back_to_serving() -> None:
    async with serving_tree(mode="aggregated", decode_workers=2) as tree:
        await tree.engine("decode-0").ask(control.InjectFault("release_memory"))
        with pytest.raises(LifecycleError, match="rolled back"):
            await tree.lifecycle.ask(Release(worker="decode-0"), timeout=None)
        assert tree.serving.model().table.workers["decode-0"].routable
        stats = await tree.engine_stats("decode-0")
        assert stats.admitting and not stats.released
        async with httpx.AsyncClient(base_url=tree.url) as client:
            assert (await _stream_text(client, "after the rollback", 4))["error"] is None


async def test_rolling_release_keeps_n_minus_one_serving() -> None:
    async with serving_tree(mode="aggregated", decode_workers=3) as tree:
        lowest = 3
        done = anyio.Event()

        async def watch() -> None:
            nonlocal lowest
            while not done.is_set():
                lowest = min(lowest, tree.serving.routable())
                await anyio.sleep(0.001)

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            await tree.lifecycle.ask(Release(pool="decode", rolling=True), timeout=None)
            done.set()
        assert lowest == 2
        assert tree.serving.routable() == 3


async def test_control_api_needs_the_token_and_reports_errors() -> None:
    async with serving_tree(mode="aggregated", decode_workers=2) as tree:
        app = control_app(tree.lifecycle, "s3cret", lambda: None)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://control") as client:
            assert (await client.get("/control/workers")).status_code == 401
            assert (
                await client.get("/control/workers", headers={"authorization": "Bearer nope"})
            ).status_code == 403
            auth = {"authorization": "Bearer s3cret"}
            workers = await client.get("/control/workers", headers=auth)
            assert workers.status_code == 200 and set(workers.json()["result"]) == {
                "decode-0",
                "decode-1",
            }
            assert (
                await client.post("/control/drain", headers=auth, json={"worker": "ghost"})
            ).status_code == 409
            assert (
                await client.post("/control/release", headers=auth, content=b"[1")
            ).status_code == 400
            assert (await client.get("/control/unknown", headers=auth)).status_code == 404
            ok = await client.post(
                "/control/release", headers=auth, json={"worker": "decode-1", "tags": ["weights"]}
            )
            assert ok.status_code == 200
            assert (
                await client.post("/control/resume", headers=auth, json={"worker": "decode-1"})
            ).status_code == 200


def _start_root(port: int, *extra: str) -> subprocess.Popen[str]:
    engine = ["--engine-arg", 'timing={"speedup": 1.0}', "--engine-arg", "num_blocks=2048"]
    return start_root(port, "--grace-period", "0.3", *engine, *extra)


async def test_sigterm_under_load_drains_every_request_and_exits_0() -> None:
    port = free_port()
    root = _start_root(port)
    try:
        await wait_healthy(port, 60)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            results: list[dict[str, Any]] = []
            in_flight: list[int] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(_load, client, 12, results, 150, in_flight)
                with anyio.fail_after(60):
                    while len(in_flight) < 12:  # every request is streaming when the signal comes
                        await anyio.sleep(0.01)
                started = time.monotonic()
                root.send_signal(signal.SIGTERM)
            assert len(results) == 12
            assert all(r["error"] is None and r["finish"] == "length" for r in results), results
        code = await anyio.to_thread.run_sync(root.wait, 60)
        assert code == 0
        assert time.monotonic() - started < 60
    finally:
        if root.poll() is None:
            root.kill()
            root.wait()
        assert root.stdout is not None
        root.stdout.close()


async def test_second_signal_exits_at_once_with_its_own_code() -> None:
    port = free_port()
    root = _start_root(port, "--drain-budget", "60")
    try:
        await wait_healthy(port, 60)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:

            async def doomed_load() -> None:
                try:
                    await _load(client, 4, [], 2000)
                except* httpx.TransportError:
                    pass  # the root exits under these requests: that is the point

            async with anyio.create_task_group() as tg:
                tg.start_soon(doomed_load)
                await anyio.sleep(0.5)
                root.send_signal(signal.SIGTERM)
                await anyio.sleep(0.5)
                root.send_signal(signal.SIGTERM)
                code = await anyio.to_thread.run_sync(root.wait, 20)
                tg.cancel_scope.cancel()
        assert code == 70
    finally:
        if root.poll() is None:
            root.kill()
            root.wait()
        assert root.stdout is not None
        root.stdout.close()


def test_an_unknown_loop_is_a_clear_error() -> None:
    result = CliRunner().invoke(app, ["run", "--backend", "mock", "--loop", "tokio"])
    assert result.exit_code == 2, result.output
    assert "expected uvloop, asyncio or trio" in result.output
