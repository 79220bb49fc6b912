"""A decode worker crash-looping under load (real SIGKILLs of its engine process): it is
quarantined, its requests move to the healthy worker token for token, and nothing else restarts,
not the healthy worker, not its pool, not the request streams."""

from __future__ import annotations

import os
import signal
from typing import Any

import anyio
import httpx
import pytest

from actors import ActorError, current_registry
from actors.serving.worker import engine_name
from protocols import control
from supervisors import METRICS_REGISTRY
from tests.helpers.serving import serving_tree
from tests.serving.test_e2e import _stream_text

CLIENTS = 16
KILLS = 50
TOKENS = 200
# Slower than the suite's usual mock, so requests are long and few: each outlives several kills.
ENGINE = {"timing": {"speedup": 2.0}}
# A few prompts, each asked many times: every answer must equal the fault-free one.
PROMPTS = [f"tell me story number {k}" for k in range(4)]


def _events(supervisor: str, child: str, event: str) -> float:
    value = METRICS_REGISTRY.get_sample_value(
        "actorserve_supervisor_events_total",
        {"supervisor": supervisor, "child": child, "event": event},
    )
    return value or 0.0


async def _pid(worker: str) -> int | None:
    engine = current_registry().whereis(engine_name(worker))
    if engine is None:
        return None  # its worker is down (quarantined): no engine under that name
    try:
        stats: control.EngineStats = await engine.ask(control.GetStats())
    except ActorError:
        return None  # dead or restarting: no engine to ask
    return stats.pid


async def _kill_repeatedly(worker: str, kills: int) -> int:
    """SIGKILL ``worker``'s engine each time it is back, ``kills`` times."""
    killed: set[int] = set()
    while len(killed) < kills:
        pid = await _pid(worker)
        if pid is None or pid in killed:
            await anyio.sleep(0.01)
            continue
        os.kill(pid, signal.SIGKILL)
        killed.add(pid)
    return len(killed)


async def _client(
    client: httpx.AsyncClient, c: int, results: list[tuple[str, dict[str, Any]]], stop: anyio.Event
) -> None:
    i = c
    while not stop.is_set():
        prompt = PROMPTS[i % len(PROMPTS)]
        results.append((prompt, await _stream_text(client, prompt, TOKENS)))
        i += 1


@pytest.mark.slow
async def test_a_crash_looping_decode_worker_is_quarantined_and_nothing_else_moves() -> None:
    async with serving_tree(
        mode="aggregated",
        decode_workers=2,
        router="round_robin",
        quarantine_cooldown=0.05,
        engine_args=ENGINE,
    ) as tree:
        healthy_pid = await _pid("decode-0")
        streams_restarts = _events("model:mock", "streams", "restarted")
        pool_restarts = _events("model:mock", "decode-pool", "restarted")
        results: list[tuple[str, dict[str, Any]]] = []
        stop = anyio.Event()
        async with httpx.AsyncClient(base_url=tree.url) as client:
            async with anyio.create_task_group() as tg:
                for c in range(CLIENTS):
                    tg.start_soon(_client, client, c, results, stop)
                with anyio.fail_after(300):
                    kills = await _kill_repeatedly("decode-1", KILLS)
                stop.set()
            assert kills == KILLS
            assert _events("decode-pool", "decode-1", "quarantined") >= 1
            assert all(got["error"] is None for _, got in results), results
            assert len(results) >= CLIENTS
            # Fault-free (decode-1 quarantined or back, nothing killed now), the same prompts.
            expected = {prompt: await _stream_text(client, prompt, TOKENS) for prompt in PROMPTS}
            for prompt, got in results:
                want = expected[prompt]
                assert (got["text"], got["finish"]) == (want["text"], want["finish"]), prompt
        assert await _pid("decode-0") == healthy_pid
        assert _events("model:mock", "streams", "restarted") == streams_restarts
        assert _events("model:mock", "decode-pool", "restarted") == pool_restarts
