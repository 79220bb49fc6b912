"""Errors in OpenAI's format with the right status, before and after the first chunk; client
disconnects cancel the backend; the server keeps serving after bad input."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import openai
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from starlette.types import Message

from actors.serving.frontend import create_app
from actors.serving.testing import CONTEXT, MODEL, FakeBackend
from actors.testing import wait_until
from protocols.errors import EngineFailure, NoWorkerAvailable, Overloaded, WorkerDraining
from tests.frontend._http import (
    CHAT,
    COMPLETIONS,
    chat_body,
    open_raw_stream,
    read_until,
    sse_events,
)
from tests.frontend.conftest import served

JSON = {"content-type": "application/json"}
_INVALID = {
    "model": "",
    "endpoint": CHAT,
    "request_type": "",
    "status": "error",
    "error_type": "validation",
}


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return dict(error)


BAD_BODIES: list[tuple[str, dict[str, Any] | bytes, str | None]] = [
    ("malformed JSON", b'{"model": "mock-model", "messages": [', None),
    ("not an object", b"[1, 2, 3]", None),
    ("messages missing", {"model": MODEL}, "messages"),
    ("messages wrong type", {"model": MODEL, "messages": 5}, "messages"),
    ("role unknown", chat_body() | {"messages": [{"role": "wizard", "content": "x"}]}, None),
    ("max_tokens a string", chat_body(max_tokens="ten"), "max_tokens"),
    ("max_tokens negative", chat_body(max_tokens=-1), "max_tokens"),
    ("max_tokens zero", chat_body(max_tokens=0), "max_tokens"),
    ("temperature a bool", chat_body(temperature=True), "temperature"),
    ("temperature negative", chat_body(temperature=-0.1), "temperature"),
    ("top_p above one", chat_body(top_p=1.5), "top_p"),
    ("stream a string", chat_body(stream="yes"), "stream"),
    ("stop a number", chat_body(stop=5), None),
    ("seed too large", chat_body(seed=2**80), "seed"),
    ("n above 128", chat_body(n=129), "n"),
    (
        "usage on every chunk",
        chat_body(stream=True, stream_options={"continuous_usage_stats": True}),
        "stream_options.continuous_usage_stats",
    ),
    ("n zero", chat_body(n=0), "n"),
    (
        "stream_options without stream",
        chat_body(stream_options={"include_usage": True}),
        "stream_options",
    ),
    ("logit_bias key not a token id", chat_body(logit_bias={"hi": 1}), "logit_bias"),
    ("logit_bias above 100", chat_body(logit_bias={"5": 101}), "logit_bias"),
    (
        "two grammars",
        chat_body(response_format={"type": "json_object"}, regex="a+"),
        "regex",
    ),
    ("regex and ebnf", chat_body(regex="a+", ebnf='root ::= "a"'), "ebnf"),
    ("deprecated functions", chat_body(functions=[{"name": "f"}]), "functions"),
    ("top_logprobs above 20", chat_body(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("min_tokens above max_tokens", chat_body(max_tokens=2, min_tokens=5), "min_tokens"),
    (
        "image content",
        chat_body() | {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        None,
    ),
]


@pytest.mark.parametrize(("case", "body", "param"), BAD_BODIES, ids=[c[0] for c in BAD_BODIES])
async def test_bad_request_is_400_and_server_keeps_serving(
    base_url: str, case: str, body: dict[str, Any] | bytes, param: str | None
) -> None:
    async with httpx.AsyncClient(base_url=base_url) as client:
        if isinstance(body, bytes):
            r = await client.post(CHAT, content=body, headers={"content-type": "application/json"})
        else:
            r = await client.post(CHAT, json=body)
        error = _error(r, 400)
        assert error["type"] == "invalid_request_error"
        if param is not None:
            assert error["param"] is not None and error["param"].startswith(param), error
        ok = await client.post(CHAT, json=chat_body())
        assert ok.status_code == 200


async def test_malformed_json_is_named(base_url: str) -> None:
    async with httpx.AsyncClient(base_url=base_url) as client:
        r = await client.post(
            COMPLETIONS, content=b"{bad", headers={"content-type": "application/json"}
        )
    error = _error(r, 400)
    assert error["code"] == "json_invalid"
    assert "Invalid JSON" in error["message"]


async def test_lone_surrogate_is_400(base_url: str) -> None:
    raw = b'{"model": "mock-model", "messages": [{"role": "user", "content": "\\ud800"}]}'
    async with httpx.AsyncClient(base_url=base_url) as client:
        r = await client.post(CHAT, content=raw, headers={"content-type": "application/json"})
    assert "Unicode" in _error(r, 400)["message"]


async def test_unknown_model_is_404(base_url: str) -> None:
    async with httpx.AsyncClient(base_url=base_url) as client:
        r = await client.post(CHAT, json=chat_body() | {"model": "gpt-nope"})
    error = _error(r, 404)
    assert error["code"] == "model_not_found"
    assert error["param"] == "model"


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_prompt_longer_than_context_is_400(base_url: str, path: str) -> None:
    long = "x" * (CONTEXT + 10)
    body = chat_body(long) if path == CHAT else {"model": MODEL, "prompt": long}
    async with httpx.AsyncClient(base_url=base_url) as client:
        r = await client.post(path, json=body)
        too_many = await client.post(path, json={**body, "prompt": "hi", "max_tokens": CONTEXT})
    error = _error(r, 400)
    assert error["code"] == "context_length_exceeded"
    assert str(CONTEXT) in error["message"]
    if path == COMPLETIONS:
        assert _error(too_many, 400)["code"] == "context_length_exceeded"


async def test_empty_and_too_large_batches_are_400(base_url: str) -> None:
    async with httpx.AsyncClient(base_url=base_url) as client:
        empty = await client.post(COMPLETIONS, json={"model": MODEL, "prompt": []})
        batch = await client.post(COMPLETIONS, json={"model": MODEL, "prompt": ["a"] * 65})
        choices = await client.post(
            COMPLETIONS, json={"model": MODEL, "prompt": ["a"] * 10, "n": 13}
        )
        best_of = await client.post(
            COMPLETIONS, json={"model": MODEL, "prompt": ["a"] * 10, "best_of": 13}
        )
    assert _error(empty, 400)["param"] == "prompt"
    assert _error(batch, 400)["param"] == "prompt"
    assert "at most 128 choices" in _error(choices, 400)["message"]
    assert _error(best_of, 400)["param"] == "best_of"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (Overloaded("busy"), 503),
        (NoWorkerAvailable("no worker"), 503),
        (WorkerDraining("draining"), 503),
        (EngineFailure("engine died"), 500),
    ],
)
async def test_backend_errors_before_first_chunk_get_their_status(
    base_url: str, backend: FakeBackend, exc: Exception, status: int, stream: bool
) -> None:
    backend.error_before = exc
    async with httpx.AsyncClient(base_url=base_url) as client:
        r = await client.post(CHAT, json=chat_body(stream=stream))
    error = _error(r, status)
    assert error["message"] == str(exc)
    if status == 503:
        assert r.headers["retry-after"] == "1"
    else:
        assert error["type"] == "server_error"


@pytest.mark.parametrize("stream", [False, True])
async def test_error_in_first_output_gets_its_status(
    base_url: str, backend: FakeBackend, stream: bool
) -> None:
    backend.error_after = (0, Overloaded("queue full"))
    async with httpx.AsyncClient(base_url=base_url) as client:
        r = await client.post(CHAT, json=chat_body(stream=stream))
    _error(r, 503)
    assert r.headers["retry-after"] == "1"


async def test_unexpected_exception_is_500_and_server_keeps_serving(
    base_url: str, backend: FakeBackend
) -> None:
    backend.error_before = RuntimeError("bug in the backend")
    async with httpx.AsyncClient(base_url=base_url) as client:
        r = await client.post(CHAT, json=chat_body())
        error = _error(r, 500)
        assert error["type"] == "server_error"
        assert "bug" not in error["message"]  # internals are logged, not sent
        backend.error_before = None
        assert (await client.post(CHAT, json=chat_body())).status_code == 200


async def test_max_inflight_overload_is_503_with_retry_after(backend: FakeBackend) -> None:
    backend.hang_after = 1
    app = create_app(backend, CollectorRegistry(), max_inflight=1, retry_after_s=7)
    async with served(app) as url:
        stream = await open_raw_stream(url, CHAT, chat_body(stream=True))
        async with stream:
            await read_until(stream, b"data:")
            async with httpx.AsyncClient(base_url=url) as client:
                r = await client.post(CHAT, json=chat_body())
            error = _error(r, 503)
            assert r.headers["retry-after"] == "7"
            assert "in flight" in error["message"]


async def test_max_inflight_holds_for_requests_arriving_together(backend: FakeBackend) -> None:
    backend.hang_after = 1
    app = create_app(backend, CollectorRegistry(), max_inflight=2)
    async with served(app) as url:
        conns = [await open_raw_stream(url, CHAT, chat_body(stream=True)) for _ in range(5)]
        try:
            heads = [await read_until(conn, b"\r\n") for conn in conns]
        finally:
            for conn in conns:
                await conn.aclose()
    statuses = sorted(head.split(b" ")[1] for head in heads)
    assert statuses == [b"200", b"200", b"503", b"503", b"503"]


def _stream_error(text: str) -> dict[str, Any]:
    events = sse_events(text)
    assert events[-1] == (None, "[DONE]")
    name, data = events[-2]
    assert name == "error"
    assert all(n is None for n, _ in events[:-2])  # the chunks before it are ordinary
    return dict(json.loads(data)["error"])


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_error_mid_stream_is_an_sse_error_event(
    base_url: str, backend: FakeBackend, path: str
) -> None:
    backend.error_after = (3, EngineFailure("engine died mid-stream"))
    body = (
        chat_body(stream=True) if path == CHAT else {"model": MODEL, "prompt": "x", "stream": True}
    )
    async with httpx.AsyncClient(base_url=base_url) as client:
        r = await client.post(path, json=body)
    assert r.status_code == 200
    error = _stream_error(r.text)
    assert error["message"] == "engine died mid-stream"
    assert error["code"] == "backend.engine_failure"
    assert error["type"] == "server_error"


async def test_engine_error_finish_and_truncated_stream_are_error_events(
    base_url: str, backend: FakeBackend
) -> None:
    async with httpx.AsyncClient(base_url=base_url) as client:
        backend.finish_error = "CUDA fault"
        failed = await client.post(CHAT, json=chat_body(stream=True))
        backend.finish_error = None
        backend.truncate = True
        truncated = await client.post(CHAT, json=chat_body(stream=True))
        unary = await client.post(CHAT, json=chat_body())
    assert _stream_error(failed.text)["message"] == "CUDA fault"
    assert _stream_error(truncated.text)["code"] == "backend.stream_incomplete"
    assert _error(unary, 500)["code"] == "backend.stream_incomplete"


def _openai_stream_error(base_url: str) -> str:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0) as client:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        with pytest.raises(openai.APIError) as info:
            for _ in stream:
                pass
    return info.value.message


async def test_openai_client_raises_on_a_mid_stream_error(
    base_url: str, backend: FakeBackend
) -> None:
    backend.error_after = (2, EngineFailure("went away"))
    assert await anyio.to_thread.run_sync(_openai_stream_error, base_url) == "went away"


async def test_oversized_body_is_413_before_it_is_parsed(backend: FakeBackend) -> None:
    app = create_app(backend, CollectorRegistry(), max_body_bytes=1024)

    async def streamed() -> AsyncIterator[bytes]:  # no Content-Length: refused once past it
        for _ in range(4):
            yield b" " * 512

    async with served(app) as url, httpx.AsyncClient(base_url=url) as client:
        announced = await client.post(CHAT, json=chat_body("x" * 2000))
        sent = await client.post(CHAT, content=streamed(), headers=JSON)
        for r in (announced, sent):
            assert _error(r, 413)["message"] == "Content Too Large"
        assert not backend.requests
        assert (await client.post(CHAT, json=chat_body())).status_code == 200


async def test_unknown_route_and_method_use_the_error_format(base_url: str) -> None:
    async with httpx.AsyncClient(base_url=base_url) as client:
        missing = await client.get("/v1/nothing")
        wrong = await client.get(CHAT)
        slash = await client.post(f"{CHAT}/", json=chat_body())
    assert _error(missing, 404)["type"] == "invalid_request_error"
    _error(wrong, 405)
    assert wrong.headers["allow"] == "POST"
    assert slash.status_code == 307 and slash.headers["location"].endswith(CHAT)


# --- client disconnects ----------------------------------------------------------------------


async def _wait_value(registry: CollectorRegistry, name: str, labels: dict[str, str]) -> None:
    # The outcome is recorded just after the backend saw its cancel: poll briefly for it.
    await wait_until(lambda: registry.get_sample_value(name, labels) == 1)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_disconnect_mid_stream_cancels_the_backend(
    base_url: str, backend: FakeBackend, registry: CollectorRegistry, path: str
) -> None:
    backend.hang_after = 4
    body = (
        chat_body(stream=True) if path == CHAT else {"model": MODEL, "prompt": "x", "stream": True}
    )
    stream = await open_raw_stream(base_url, path, body)
    async with stream:
        head = await read_until(stream, b"data:")
        assert head.startswith(b"HTTP/1.1 200")
    # The socket is closed: the backend's iterator must be cancelled promptly.
    with anyio.fail_after(10):
        await backend.cancel_seen.wait()
    assert backend.cancelled == [backend.requests[0].rid]
    labels = {"model": MODEL}
    await _wait_value(registry, "actorserve_frontend_disconnected_clients_total", labels)
    outcome = {"endpoint": path, "request_type": "stream", "status": "cancelled", "error_type": ""}
    await _wait_value(registry, "actorserve_frontend_requests_total", labels | outcome)
    assert registry.get_sample_value("actorserve_frontend_active_requests", labels) == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_disconnect_before_first_output_cancels_the_backend(
    base_url: str, backend: FakeBackend, registry: CollectorRegistry, stream: bool
) -> None:
    backend.hang_after = 0  # a long queue or prefill: nothing comes
    conn = await open_raw_stream(base_url, CHAT, chat_body(stream=stream))
    with anyio.fail_after(10):
        await backend.request_seen.wait()
    await conn.aclose()
    with anyio.fail_after(10):
        await backend.cancel_seen.wait()
    assert backend.cancelled == [backend.requests[0].rid]
    await _wait_value(registry, "actorserve_frontend_disconnected_clients_total", {"model": MODEL})


async def test_server_serves_again_after_a_disconnect(base_url: str, backend: FakeBackend) -> None:
    backend.hang_after = 2
    conn = await open_raw_stream(base_url, CHAT, chat_body(stream=True))
    async with conn:
        await read_until(conn, b"data:")
    with anyio.fail_after(10):
        await backend.cancel_seen.wait()
    backend.hang_after = None
    async with httpx.AsyncClient(base_url=base_url) as client:
        assert (await client.post(CHAT, json=chat_body(stream=True))).status_code == 200


_CHAT = json.dumps(chat_body()).encode()

_NOT_AN_OBJECT = "model_attributes_type"

# (path, body, headers, status, error code, error param): what the API answers for bodies at the
# edges of the rules (content type, encoding, size, shape).
_EDGE_BODIES: list[tuple[str, bytes, dict[str, str], int, str | None, str | None]] = [
    (CHAT, _CHAT, JSON, 200, None, None),
    (CHAT, json.dumps(chat_body(stream=True)).encode(), JSON, 200, None, None),
    (CHAT, _CHAT, {"content-type": "application/json; charset=utf-8"}, 200, None, None),
    (CHAT, _CHAT, {"content-type": "Application/JSON"}, 200, None, None),
    (CHAT, _CHAT, {"content-type": "application/vnd.x+json"}, 200, None, None),
    (CHAT, json.dumps(chat_body()).encode("utf-16"), JSON, 200, None, None),
    (CHAT, _CHAT, {"content-type": "text/plain"}, 400, _NOT_AN_OBJECT, None),
    (CHAT, _CHAT, {"content-type": "application/json, text/plain"}, 400, _NOT_AN_OBJECT, None),
    (CHAT, _CHAT, {}, 400, _NOT_AN_OBJECT, None),
    (CHAT, b"", JSON, 400, "missing", None),
    (CHAT, b"[1, 2]", JSON, 400, _NOT_AN_OBJECT, None),
    (CHAT, b'{"model": "mock-model", "messages": NaN}', JSON, 400, "list_type", "messages"),
    (CHAT, json.dumps(chat_body(temperature="0.5")).encode(), JSON, 400, "float_type", None),
    (CHAT, b'{"model": "\xff"}', JSON, 400, None, None),  # not UTF-8
    (CHAT, b"[" * 1000 + b"]" * 1000, JSON, 400, None, None),  # too deep to parse
    (COMPLETIONS, b"{bad", JSON, 400, "json_invalid", None),
    (COMPLETIONS, b'{"model": "mock-model", "prompt": "hi"}', {}, 400, _NOT_AN_OBJECT, None),
    (COMPLETIONS, json.dumps({"model": MODEL, "prompt": "x" * 3000}).encode(), {}, 413, None, None),
]


async def test_bodies_at_the_edges_of_the_rules(backend: FakeBackend) -> None:
    """A body counts as JSON when its content type names JSON (``application/json`` or
    ``application/*+json``, any parameters, any case), in any JSON encoding; the size limit comes
    first; anything else is refused in the error format, and the server keeps serving."""
    app = create_app(backend, CollectorRegistry(), max_body_bytes=2048)
    async with served(app) as url, httpx.AsyncClient(base_url=url) as client:
        for path, body, headers, status, code, param in _EDGE_BODIES:
            r = await client.post(path, content=body, headers=headers)
            case = (path, body[:40], headers)
            if status == 200:
                assert r.status_code == 200, (case, r.text)
                continue
            error = _error(r, status)
            assert error["type"] == "invalid_request_error", case
            if code is not None:
                assert error["code"] == code, (case, error)
            if param is not None:
                assert error["param"] == param, (case, error)
        assert (await client.post(CHAT, json=chat_body())).status_code == 200


async def test_a_client_gone_while_sending_gets_no_answer(
    app: FastAPI, backend: FakeBackend, registry: CollectorRegistry
) -> None:
    messages: list[Message] = [
        {"type": "http.request", "body": b'{"model": ', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[Message] = []

    async def receive() -> Message:
        return messages.pop(0)

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": CHAT,
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000")],
    }
    await app(scope, receive, send)
    assert not sent and not messages
    assert not backend.requests
    # Not a bad request: nothing was counted.
    assert registry.get_sample_value("actorserve_frontend_requests_total", _INVALID) is None
