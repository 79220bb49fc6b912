"""A pool that restarts as a whole (its supervisor crashed, or escalated) under load: the request
streams run on, and every in-flight request completes token for token as in a fault-free run,
moved to the restarted workers; while no worker of a role is routable, new requests get 503 with
Retry-After."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from actors import ExitReason, current_registry
from actors.serving.requests import RequestOutputs
from actors.serving.routing import Role
from actors.testing import crash, exit_with, wait_until
from protocols import PreprocessedRequest, SamplingOptions, StopConditions
from protocols.errors import NoWorkerAvailable
from supervisors import METRICS_REGISTRY, SupervisorRef
from tests.helpers.serving import Tree, serving_tree
from tests.serving.test_e2e import _stream_text

PROMPTS = [f"pool restart request {i}: tell me a long story" for i in range(8)]
TOKENS = 160
# Slow enough that every request is still decoding when its pool goes down.
ENGINE = {"timing": {"speedup": 2.0}}


def _restarts(supervisor: str, child: str) -> float:
    value = METRICS_REGISTRY.get_sample_value(
        "actorserve_supervisor_events_total",
        {"supervisor": supervisor, "child": child, "event": "restarted"},
    )
    return value or 0.0


async def _pool(tree: Tree, pool: str) -> SupervisorRef:
    model = SupervisorRef(await tree.root.child(f"model:{tree.serving.config.model}"))
    return SupervisorRef(await model.child(pool))


async def _run_all(
    client: httpx.AsyncClient, chunks: list[int] | None = None
) -> list[dict[str, Any]]:
    """Every prompt at once; ``chunks[i]`` counts request ``i``'s chunks so far."""
    results: dict[int, dict[str, Any]] = {}

    async def one(i: int) -> None:
        def seen(n: int) -> None:
            if chunks is not None:
                chunks[i] = n

        results[i] = await _stream_text(client, PROMPTS[i], TOKENS, on_chunk=seen)

    async with anyio.create_task_group() as tg:
        for i in range(len(PROMPTS)):
            tg.start_soon(one, i)
    return [results[i] for i in range(len(PROMPTS))]


# What its parent sees of a supervisor that gave up after too many restarts of its children.
ESCALATION = ExitReason.shutdown("reached_max_restart_intensity")


@pytest.mark.parametrize(
    ("mode", "pool", "fault"),
    [
        ("aggregated", "decode-pool", "crash"),
        ("disaggregated", "decode-pool", "crash"),
        ("disaggregated", "decode-pool", "escalate"),
        ("disaggregated", "prefill-pool", "crash"),
    ],
)
async def test_in_flight_requests_move_to_the_restarted_pool_unchanged(
    mode: str, pool: str, fault: str
) -> None:
    model = "model:mock"
    async with serving_tree(
        mode=mode, prefill_workers=1, decode_workers=2, engine_args=ENGINE
    ) as tree:
        async with httpx.AsyncClient(base_url=tree.url) as client:
            expected = await _run_all(client)
            streams_restarts = _restarts(model, "streams")
            pool_restarts = _restarts(model, pool)
            chunks = [0] * len(PROMPTS)
            results: list[dict[str, Any]] = []

            async def load() -> None:
                results.extend(await _run_all(client, chunks))

            async with anyio.create_task_group() as tg:
                tg.start_soon(load)
                # Every request is streaming (its first chunks are out) when the pool goes.
                await wait_until(lambda: min(chunks) >= 2, timeout=30)
                ref = (await _pool(tree, pool)).ref
                # A crash kills its workers at once (their requests migrate); an escalation
                # stops them in order (each engine lets its streams finish first).
                await (crash(ref) if fault == "crash" else exit_with(ref, ESCALATION))
        # (Counted once the pool's last worker started: its first may have served them all.)
        await wait_until(lambda: _restarts(model, pool) == pool_restarts + 1, timeout=30)
        assert _restarts(model, "streams") == streams_restarts
        assert [r["error"] for r in results] == [None] * len(PROMPTS)
        assert [(r["text"], r["finish"]) for r in results] == [
            (r["text"], r["finish"]) for r in expected
        ]
        assert all(r["usage"]["completion_tokens"] == TOKENS for r in results)


@pytest.mark.parametrize("mode", ["aggregated", "disaggregated"])
async def test_no_routable_decode_worker_means_503_with_retry_after(
    mode: str, tmp_path: Path
) -> None:
    # A count of start failures the engines read as they start: while it is > 0 each decode
    # engine that restarts fails again, so no decode worker is routable until it is 0.
    failures = tmp_path / "fail-start"
    failures.write_text("0")
    async with serving_tree(
        mode=mode,
        prefill_workers=1,
        decode_workers=2,
        quarantine_cooldown=0.05,
        engine_args={"fail_start_file": str(failures)},
    ) as tree:
        serving, table = tree.serving, tree.serving.model().table
        role: Role = "aggregated" if mode == "aggregated" else "decode"
        failures.write_text("1000000")
        for worker in [w for w, r in serving.roles.items() if r == role]:
            os.kill((await tree.engine_stats(worker)).pid, signal.SIGKILL)
        await wait_until(lambda: not table.candidates(role), timeout=30)
        async with httpx.AsyncClient(base_url=tree.url) as client:
            # A prefill worker alone does not make a disaggregated model ready.
            health = await client.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "notready"
            for stream in (True, False):
                body = {"model": "mock", "prompt": "anyone?", "max_tokens": 4, "stream": stream}
                response = await client.post("/v1/completions", json=body, timeout=30)
                assert response.status_code == 503, response.text
                assert int(response.headers["retry-after"]) >= 1
                assert response.json()["error"]["code"] == "capacity.no_worker"
            # One admitted just before (past the gate): its first routing fails as well, at
            # once, instead of waiting for a worker (the guard is far below the stall timeout).
            streams = current_registry().whereis(serving.model().streams_name)
            assert streams is not None
            serving.admission.enter()
            outputs = RequestOutputs(SupervisorRef(streams), _request(), serving.admission, 600)
            try:
                with pytest.raises(NoWorkerAvailable), anyio.fail_after(10):
                    await outputs.__anext__()
            finally:
                outputs.close()
            failures.write_text("0")
            await tree.wait_ready()
            assert (await client.get("/health")).status_code == 200
            served = await _stream_text(client, "anyone?", 4)
        assert served["error"] is None and served["finish"] == "length"


def _request() -> PreprocessedRequest:
    return PreprocessedRequest(
        rid="admitted-before",
        token_ids=list(b"anyone?"),
        stop_conditions=StopConditions(max_tokens=4),
        sampling_options=SamplingOptions(temperature=0.0),
    )
