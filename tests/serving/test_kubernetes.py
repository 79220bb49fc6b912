"""Kubernetes-shaped behaviour from the outside: ``/health`` (the readiness probe) stays 200
while a model can serve and shows each worker, ``/live`` only says the root answers, and a
SIGTERM'd root under load is gone within Kubernetes' default 30 s termination grace."""

from __future__ import annotations

import os
import signal
import ssl
from pathlib import Path
from typing import Any

import anyio
import httpx

from actors.lowlevel import free_port
from actors.serving.root import wait_healthy
from tests.helpers.serving import serving_tree, start_root
from tests.helpers.tls import self_signed

#: Kubernetes' default ``terminationGracePeriodSeconds``: SIGKILL follows SIGTERM after it.
K8S_GRACE_S = 30.0


def _workers(health: httpx.Response, model: str) -> dict[str, Any]:
    workers: dict[str, Any] = health.json()["models"][model]["workers"]
    return workers


async def test_health_stays_ready_while_one_of_two_decode_workers_restarts(
    tmp_path: Path,
) -> None:
    # A count of start failures the engines read as they start: the killed engine's first
    # restarts fail, so it stays down long enough to be seen restarting, then comes back.
    failures = tmp_path / "fail-start"
    failures.write_text("0")
    async with serving_tree(
        mode="disaggregated",
        prefill_workers=1,
        decode_workers=2,
        quarantine_cooldown=0.05,
        engine_args={"fail_start_file": str(failures)},
    ) as tree:
        model = tree.serving.config.model
        async with httpx.AsyncClient(base_url=tree.url) as client:
            health = await client.get("/health")
            assert health.status_code == 200, health.text
            assert _workers(health, model) == {
                "prefill-0": {"role": "prefill", "state": "ready"},
                "decode-0": {"role": "decode", "state": "ready"},
                "decode-1": {"role": "decode", "state": "ready"},
            }

            failures.write_text("2")
            os.kill((await tree.engine_stats("decode-0")).pid, signal.SIGKILL)
            seen: list[str] = []
            with anyio.fail_after(30):
                while "restarting" not in seen:
                    health = await client.get("/health")
                    # One decode worker is enough: the pod stays in its Service throughout.
                    assert health.status_code == 200, health.text
                    workers = _workers(health, model)
                    assert workers["decode-1"]["state"] == "ready"
                    seen.append(workers["decode-0"]["state"])
                    await anyio.sleep(0.01)
            await tree.wait_ready()
            health = await client.get("/health")
            assert health.status_code == 200
            assert _workers(health, model)["decode-0"]["state"] == "ready"

            # The only prefill worker down: the model cannot serve, so the pod is not ready.
            failures.write_text("1000000")
            os.kill((await tree.engine_stats("prefill-0")).pid, signal.SIGKILL)
            with anyio.fail_after(30):
                while (health := await client.get("/health")).status_code == 200:
                    await anyio.sleep(0.01)
            assert health.status_code == 503
            body = health.json()
            assert body["status"] == "notready"
            assert body["models"][model]["reason"] == "no routable prefill worker"
            assert body["models"][model]["workers"]["prefill-0"]["state"] == "restarting"
            assert (await client.get("/live")).status_code == 200  # alive all the same
            failures.write_text("0")
            await tree.wait_ready()
            assert (await client.get("/health")).status_code == 200


async def test_the_root_serves_https_with_keys_and_limits_from_its_config(tmp_path: Path) -> None:
    tls = self_signed(tmp_path)
    keys = tmp_path / "keys"
    keys.write_text("sk-from-file\n")
    async with serving_tree(
        mode="aggregated",
        decode_workers=1,
        api_key=["sk-flag"],
        api_key_file=str(keys),
        api_key_protects=["metrics"],
        ssl_certfile=tls.certfile,
        ssl_keyfile=tls.keyfile,
        max_body_bytes=4096,
    ) as tree:
        url = tree.url.replace("http://", "https://")
        trust = ssl.create_default_context(cafile=tls.certfile)
        body = {"model": "mock", "prompt": "hi", "max_tokens": 4}
        async with httpx.AsyncClient(base_url=url, verify=trust) as client:
            refused = await client.post("/v1/completions", json=body)
            for key in ("sk-flag", "sk-from-file"):
                served = await client.post("/v1/completions", json=body, headers=_bearer(key))
                assert served.status_code == 200, served.text
            large = {**body, "prompt": "x" * 5000}
            too_large = await client.post("/v1/completions", json=large, headers=_bearer("sk-flag"))
            health = await client.get("/health")
            metrics = await client.get("/metrics")
    assert refused.status_code == 401
    assert too_large.status_code == 413
    assert health.status_code == 200  # probes need no key...
    assert metrics.status_code == 401  # ...unless the operator said so


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def _stream(client: httpx.AsyncClient, results: list[str]) -> None:
    """One long streamed completion: how it ended (finished, an error event, or refused)."""
    body = {"model": "mock", "prompt": "go on", "max_tokens": 3000, "stream": True}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                results.append(f"status {response.status_code}")
                return
            text = "".join([chunk async for chunk in response.aiter_text()])
        results.append("error event" if "event: error" in text else "finished")
    except httpx.TransportError as exc:
        results.append(f"transport {type(exc).__name__}")


async def test_sigterm_under_load_ends_inside_kubernetes_default_grace() -> None:
    port = free_port()
    root = start_root(port, "--decode-workers", "2")  # every stop budget at its default
    try:
        await wait_healthy(port, 60)
        results: list[str] = []
        async with (
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client,
            anyio.create_task_group() as tg,
        ):
            for _ in range(6):
                tg.start_soon(_stream, client, results)
            await anyio.sleep(1.0)  # the streams are running
            root.send_signal(signal.SIGTERM)
            await anyio.sleep(0.3)
            # Out of the Service at once (still serving what was routed before).
            health = await client.get("/health")
            assert health.status_code == 503
            assert health.json()["models"]["mock"]["reason"] == "shutting down"
            # A deadline, not a benchmark: Kubernetes would SIGKILL the pod past it.
            code = await anyio.to_thread.run_sync(root.wait, K8S_GRACE_S)
        assert code == 0
        assert len(results) == 6
        # Each stream ended as the client can tell: finished, or an error event (the drain
        # budget ran out), never hanging.
        assert all(r in ("finished", "error event") for r in results), results
    finally:
        if root.poll() is None:
            root.kill()
        root.communicate(timeout=30)
