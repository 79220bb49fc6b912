"""Schemathesis over the app's own OpenAPI schema: no input makes it answer 5xx or hang, every
answer is the documented one, and every field the schema allows is served (or refused only for a
limit no schema states), whole numbers written as floats too.

The app runs under our server on 127.0.0.1 (in an event loop thread this module owns), and every
generated request goes over a real connection.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import schemathesis
from anyio.from_thread import start_blocking_portal
from hypothesis import HealthCheck, Phase, given, settings
from prometheus_client import CollectorRegistry
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from actors.serving.frontend import create_app
from actors.serving.testing import MODEL, FakeBackend
from tests.frontend._http import CHAT, COMPLETIONS
from tests.frontend.conftest import served

# No 5xx, and every response matches the documented status codes, content types and shapes (the
# msgspec encoders against the pydantic documentation models). Not "positive data accepted":
# semantic limits the schema cannot state (context length, min_tokens <= max_tokens, best_of >= n)
# rightly answer 400 to schema-valid input.
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]

app = create_app(FakeBackend(), CollectorRegistry())
schema = schemathesis.openapi.from_dict(app.openapi())


@pytest.fixture(scope="module")
def fuzz_url() -> Iterator[str]:
    with (
        start_blocking_portal("asyncio") as portal,
        # Hypercorn keeps a connection's socket until its keep-alive timer ends, even after the
        # client closed it; a short timer keeps the per-test socket-leak check from waiting.
        portal.wrap_async_context_manager(served(app, keep_alive_timeout_s=0.05)) as url,
    ):
        yield url


@schema.parametrize()
@settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
def test_no_input_gets_a_5xx_or_hangs(case: schemathesis.Case[Any], fuzz_url: str) -> None:
    # A random model name only ever reaches the 404; naming the served model sends the rest of
    # the generated request down the tokenise-generate-stream path.
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = MODEL
    with requests.Session() as session:
        case.call_and_validate(base_url=fuzz_url, session=session, checks=CHECKS, timeout=10)


#: What a schema-valid body may still be refused for, as ``(param, code)``: limits that depend on
#: the prompt's tokens or tie two fields together, which no JSON schema states.
SEMANTIC_REFUSALS = {
    ("messages", "context_length_exceeded"),
    ("prompt", "context_length_exceeded"),
    ("min_tokens", "request.invalid"),  # above max_tokens
    ("top_logprobs", "invalid_value"),  # above 0 without logprobs
    ("stream_options", "invalid_value"),  # without stream
    ("regex", "invalid_value"),  # with a JSON response_format
    ("ebnf", "invalid_value"),  # with a JSON response_format or a regex
    ("prompt", "invalid_value"),  # n times the prompts above the most choices
    ("best_of", "invalid_value"),  # below n, with stream, or times the prompts above the most
    ("tools", "request.invalid"),  # on a server without a --tool-call-parser (the fake's)
    ("tool_choice", "invalid_value"),  # a function not in tools, or required without tools
    ("tool_choice", "request.invalid"),  # a forced call with response_format, regex or ebnf
}
JSON = {"content-type": "application/json"}
BODIES = {
    path: app.openapi()["paths"][path]["post"]["requestBody"]["content"]["application/json"][
        "schema"
    ]["$ref"].rpartition("/")[2]
    for path in (CHAT, COMPLETIONS)
}
FIELDS = [
    (path, field)
    for path, body in BODIES.items()
    for field in app.openapi()["components"]["schemas"][body]["properties"]
]


def _requiring(path: str, field: str) -> schemathesis.APIOperation[Any, Any, Any, Any]:
    """The operation at ``path``, from a copy of the app's schema where ``field`` is required, so
    that every generated body has it."""
    spec = copy.deepcopy(app.openapi())
    body = spec["components"]["schemas"][BODIES[path]]
    body["required"] = [*body.get("required", ()), field]
    return schemathesis.openapi.from_dict(spec)[path]["POST"]


def _with_whole_floats(value: Any) -> str:
    """``value`` as JSON text, with every int written as a float (``8`` as ``8.0``)."""
    if isinstance(value, bool) or not isinstance(value, int | list | dict):
        return json.dumps(value)
    if isinstance(value, int):
        return f"{value}.0"
    if isinstance(value, list):
        return "[" + ",".join(_with_whole_floats(item) for item in value) + "]"
    items = (f"{json.dumps(key)}:{_with_whole_floats(item)}" for key, item in value.items())
    return "{" + ",".join(items) + "}"


def _outcome(response: requests.Response) -> tuple[int, str | None, str | None]:
    """Status, and the refused field and code; a 200 stream must end well."""
    if response.status_code == 200:
        if response.headers["content-type"].startswith("text/event-stream"):
            assert "event: error" not in response.text, response.text
            assert response.text.rstrip().endswith("data: [DONE]"), response.text
        return 200, None, None
    error = response.json()["error"]
    return response.status_code, error["param"], error["code"]


@pytest.mark.parametrize(("path", "field"), FIELDS, ids=[f"{p}:{f}" for p, f in FIELDS])
def test_every_field_the_schema_allows_is_served_or_refused_for_a_stated_reason(
    path: str, field: str, fuzz_url: str
) -> None:
    """Schema-valid bodies holding ``field`` are answered 200, or refused only for a limit the
    schema cannot state; and the same, whole numbers written as floats (JSON Schema's integers
    too)."""

    @settings(
        max_examples=5,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=_requiring(path, field).as_strategy())
    def check(case: schemathesis.Case[Any]) -> None:
        body = case.body
        assert isinstance(body, dict)
        if field != "model":
            body["model"] = MODEL
        as_is = session.post(url, data=json.dumps(body), headers=JSON, timeout=10)
        floats = session.post(url, data=_with_whole_floats(body), headers=JSON, timeout=10)
        outcome = _outcome(as_is)
        if outcome[0] != 200:
            assert outcome[1:] in SEMANTIC_REFUSALS or outcome == (404, "model", "model_not_found")
        assert _outcome(floats) == outcome

    url = fuzz_url + path
    with requests.Session() as session:
        check()
