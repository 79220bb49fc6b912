"""A flood of bad requests (every one refused with a 4xx) is the clients' problem, not the
workers': no worker is marked unhealthy, restarted or taken out of routing, and a good request
right after is served."""

from __future__ import annotations

from typing import Any

import anyio
import httpx

from actors.serving.worker._health import CANARIES
from actors.testing import wait_until
from tests.helpers.serving import serving_tree

FLOOD = 600
BAD: list[tuple[str, bytes | dict[str, Any]]] = [
    ("/v1/completions", b'{"model": "mock", "prompt": '),  # malformed JSON
    ("/v1/completions", {"model": "mock", "prompt": "x", "max_tokens": 0}),
    ("/v1/completions", {"model": "mock", "prompt": "x" * 5000}),  # past the context
    ("/v1/completions", {"model": "nope", "prompt": "x"}),  # an unknown model: 404
    ("/v1/chat/completions", {"model": "mock", "messages": [{"role": "wizard", "content": "x"}]}),
    ("/v1/completions", {"model": "mock", "prompt": [4294967296]}),  # not a token id
]


def _canaries(workers: list[str], *, ok: bool) -> float:
    """Canaries of ``workers`` that passed (``ok``) or failed, so far."""
    total = 0.0
    for sample in CANARIES.collect()[0].samples:
        labels = sample.labels
        passed = labels.get("outcome") == "ok"
        if sample.name.endswith("_total") and labels.get("worker") in workers and passed == ok:
            total += sample.value
    return total


async def test_a_flood_of_bad_requests_marks_no_worker_unhealthy() -> None:
    # Canaries run whenever a worker idles for 0.2 s: all through the flood.
    async with serving_tree(mode="aggregated", decode_workers=2, health_idle_after=0.2) as tree:
        workers = ["decode-0", "decode-1"]
        pids = [(await tree.engine_stats(w)).pid for w in workers]
        failed_before = _canaries(workers, ok=False)
        passed_before = _canaries(workers, ok=True)
        statuses: list[int] = []

        async def flood(client: httpx.AsyncClient, start: int) -> None:
            for i in range(start, FLOOD, 8):
                path, body = BAD[i % len(BAD)]
                if isinstance(body, bytes):
                    headers = {"content-type": "application/json"}
                    response = await client.post(path, content=body, headers=headers)
                else:
                    response = await client.post(path, json=body)
                statuses.append(response.status_code)

        async with httpx.AsyncClient(base_url=tree.url, timeout=30) as client:
            async with anyio.create_task_group() as tg:
                for start in range(8):
                    tg.start_soon(flood, client, start)
            assert len(statuses) == FLOOD
            assert all(400 <= s < 500 for s in statuses), sorted(set(statuses))
            good = await client.post(
                "/v1/completions", json={"model": "mock", "prompt": "hello", "max_tokens": 8}
            )
            assert good.status_code == 200
        assert all(w.routable for w in tree.serving.model().table.workers.values())
        assert [(await tree.engine_stats(w)).pid for w in workers] == pids
        # Health is still checked, and passes: the next canaries after the flood succeed.
        await wait_until(lambda: _canaries(workers, ok=True) > passed_before)
        assert _canaries(workers, ok=False) == failed_before
