"""A request's id: the client's ``x-request-id`` (or one made) is echoed in every response,
streamed or not, refused or failed, and every line logged while serving the request carries it."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import structlog

from actors.serving.testing import FakeBackend
from protocols.engine import EngineOutput, PreprocessedRequest
from tests.frontend._http import CHAT, COMPLETIONS, chat_body

MADE = re.compile(r"[0-9a-f]{32}")


class _Recording(FakeBackend):
    """Records the structlog context each request reaches the backend with (what the request
    stream actor takes over)."""

    def __init__(self) -> None:
        super().__init__()
        self.contexts: list[dict[str, Any]] = []

    def generate(self, model: str, request: PreprocessedRequest) -> AsyncIterator[EngineOutput]:
        self.contexts.append(structlog.contextvars.get_contextvars())
        return super().generate(model, request)


@pytest.fixture
def backend() -> FakeBackend:
    return _Recording()


@pytest.fixture
def frontend_lines() -> Iterator[io.StringIO]:
    """The frontend's log lines, rendered as JSON with the structlog context of the task that
    logged them."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.contextvars.merge_contextvars],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.JSONRenderer(),
            ],
        )
    )
    logger = logging.getLogger("actorserve.frontend")
    logger.addHandler(handler)
    try:
        yield out
    finally:
        logger.removeHandler(handler)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_request_id_is_echoed_and_reaches_the_request_path(
    base_url: str, backend: _Recording, stream: bool
) -> None:
    async with httpx.AsyncClient(base_url=base_url) as client:
        r = await client.post(
            CHAT, json=chat_body(stream=stream), headers={"x-request-id": "client id 7"}
        )
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "client id 7"
    [context] = backend.contexts
    [request] = backend.requests
    # The response's id stays ours; the lines of the request carry both.
    assert context == {"request_id": "client id 7", "rid": request.rid}
    assert request.rid.startswith("chatcmpl-")


async def test_without_a_client_id_one_is_made_for_each_request(
    base_url: str, backend: _Recording
) -> None:
    async with httpx.AsyncClient(base_url=base_url) as client:
        first = await client.post(COMPLETIONS, json={"model": "mock-model", "prompt": "hi"})
        second = await client.post(CHAT, json=chat_body(stream=True))
    made = [first.headers["x-request-id"], second.headers["x-request-id"]]
    assert all(MADE.fullmatch(value) for value in made)
    assert made[0] != made[1]
    assert [c["request_id"] for c in backend.contexts] == made


@pytest.mark.parametrize("value", ["x" * 129, "caf\u00e9"])
async def test_an_invalid_client_id_is_replaced(
    base_url: str, backend: _Recording, value: str
) -> None:
    async with httpx.AsyncClient(base_url=base_url) as client:
        r = await client.post(
            CHAT, json=chat_body(), headers=[("x-request-id", value.encode("latin-1"))]
        )
    assert r.status_code == 200
    assert MADE.fullmatch(r.headers["x-request-id"])
    assert backend.contexts[0]["request_id"] == r.headers["x-request-id"]


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("POST", CHAT, {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404),
        ("POST", CHAT, {"model": "mock-model"}, 400),  # refused by the door
        ("GET", CHAT, None, 405),
        ("GET", "/v1/models", None, 200),  # served by FastAPI, not the door
        ("GET", "/no/such/path", None, 404),
    ],
)
async def test_every_response_echoes_the_id(
    base_url: str, method: str, path: str, body: Any, status: int
) -> None:
    async with httpx.AsyncClient(base_url=base_url) as client:
        r = await client.request(method, path, json=body, headers={"x-request-id": "abc-1"})
    assert r.status_code == status
    assert r.headers.get_list("x-request-id") == ["abc-1"]


async def test_a_failure_is_logged_with_the_request_ids(
    base_url: str, backend: _Recording, frontend_lines: io.StringIO
) -> None:
    backend.error_after = (1, RuntimeError("bug in the backend"))
    async with httpx.AsyncClient(base_url=base_url) as client:
        r = await client.post(
            CHAT, json=chat_body(stream=True), headers={"x-request-id": "failing-1"}
        )
        backend.error_before = RuntimeError("bug before the stream")
        unary = await client.post(CHAT, json=chat_body(), headers={"x-request-id": "failing-2"})
    assert r.headers["x-request-id"] == "failing-1"  # the status line was out: an SSE error
    assert unary.status_code == 500 and unary.headers["x-request-id"] == "failing-2"
    lines = [json.loads(line) for line in frontend_lines.getvalue().splitlines()]
    [streamed, before] = [
        line for line in lines if line["event"] in ("stream failed", "request failed")
    ]
    assert streamed["request_id"] == "failing-1"
    assert streamed["rid"] == backend.requests[0].rid
    assert before["request_id"] == "failing-2" and before["rid"].startswith("chatcmpl-")
