"""API keys and TLS, from the outside: wrong, missing and right keys on every kind of route, the
open routes and the ones an operator protects, and HTTPS with a certificate the test makes."""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from actors.serving.frontend import ApiKeys, TlsFiles, create_app, read_key_file
from actors.serving.testing import ANSWER, MODEL, FakeBackend
from tests.helpers.tls import self_signed

from .conftest import served

KEYS = ["sk-first", "sk-second"]
CHAT = "/v1/chat/completions"


def _chat(stream: bool = False) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_the_openai_routes_need_one_of_the_keys() -> None:
    backend = FakeBackend()
    app = create_app(backend, CollectorRegistry(), api_keys=ApiKeys(KEYS))
    async with served(app) as url, httpx.AsyncClient(base_url=url) as client:
        missing = await client.post(CHAT, json=_chat())
        wrong = await client.post(CHAT, json=_chat(), headers=_bearer("sk-third"))
        prefix = await client.post(CHAT, json=_chat(), headers=_bearer("sk-firs"))
        basic = await client.post(CHAT, json=_chat(), headers={"authorization": "Basic sk-first"})
        models = await client.get("/v1/models")
        refused_requests = len(backend.requests)
        right = await client.post(CHAT, json=_chat(), headers=_bearer("sk-second"))
        lower = await client.post(
            CHAT, json=_chat(True), headers={"authorization": "bearer sk-first"}
        )
        listed = await client.get("/v1/models", headers=_bearer("sk-first"))
        health = await client.get("/health")
        live = await client.get("/live")
        metrics = await client.get("/metrics")
    for refused in (missing, wrong, prefix, basic, models):
        assert refused.status_code == 401, refused.text
        assert refused.headers["www-authenticate"] == "Bearer"
        error = refused.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    assert "didn't provide an API key" in missing.json()["error"]["message"]
    assert "Incorrect API key" in wrong.json()["error"]["message"]
    assert refused_requests == 0  # refused before the body was read or the backend called
    assert right.status_code == 200
    assert right.json()["choices"][0]["message"]["content"] == ANSWER
    assert lower.status_code == 200 and "[DONE]" in lower.text
    assert listed.status_code == 200 and listed.json()["data"][0]["id"] == MODEL
    # Probes and scrapers need no key unless the operator says so.
    assert (health.status_code, live.status_code, metrics.status_code) == (200, 200, 200)


async def test_the_operator_can_protect_health_and_metrics_too() -> None:
    keys = ApiKeys(KEYS, protects=["health", "metrics"])
    app = create_app(FakeBackend(), CollectorRegistry(), api_keys=keys)
    async with served(app) as url, httpx.AsyncClient(base_url=url) as client:
        health = await client.get("/health")
        metrics = await client.get("/metrics")
        live = await client.get("/live")
        keyed = await client.get("/health", headers=_bearer("sk-first"))
        scraped = await client.get("/metrics", headers=_bearer("sk-second"))
    assert (health.status_code, metrics.status_code) == (401, 401)
    assert live.status_code == 200
    assert keyed.status_code == 200 and keyed.json()["status"] == "ready"
    assert scraped.status_code == 200


def test_keys_and_what_they_protect_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# rotated monthly\nsk-a\n\n  sk-b  \n")
    assert read_key_file(path) == ["sk-a", "sk-b"]
    path.write_text("# none yet\n")
    with pytest.raises(ValueError, match="no API key"):
        read_key_file(path)
    with pytest.raises(ValueError, match="must not be empty"):
        ApiKeys([""])
    with pytest.raises(ValueError, match="cannot protect"):
        ApiKeys(["k"], protects=["docs"])


async def test_https_with_a_self_signed_certificate(tmp_path: Path) -> None:
    # On asyncio this is uvicorn's TLS, on trio hypercorn's.
    tls = self_signed(tmp_path)
    tls.check()
    app = create_app(FakeBackend(), CollectorRegistry(), api_keys=ApiKeys(KEYS))
    trust = ssl.create_default_context(cafile=tls.certfile)
    async with served(app, tls=tls) as url:
        secure = url.replace("http://", "https://")
        async with httpx.AsyncClient(base_url=secure, verify=trust) as client:
            streamed = await client.post(CHAT, json=_chat(True), headers=_bearer("sk-first"))
            refused = await client.post(CHAT, json=_chat())
        # A client that does not trust the certificate gets no answer at all.
        async with httpx.AsyncClient(base_url=secure) as untrusting:
            with pytest.raises(httpx.ConnectError):
                await untrusting.get("/live")
    assert streamed.status_code == 200 and "[DONE]" in streamed.text
    assert refused.status_code == 401


def test_a_broken_pair_fails_before_serving(tmp_path: Path) -> None:
    tls = self_signed(tmp_path)
    (tmp_path / "other").mkdir()
    other = self_signed(tmp_path / "other")
    with pytest.raises(ValueError, match=r"KEY_VALUES_MISMATCH|key values mismatch"):
        TlsFiles(tls.certfile, other.keyfile).check()
    with pytest.raises(ValueError, match=r"absent\.pem"):
        TlsFiles(str(tmp_path / "absent.pem"), tls.keyfile).check()
