"""Schemathesis over the app's own OpenAPI schema: no input makes it answer 5xx or hang, and
every answer is the documented one.

The app runs under our server on 127.0.0.1 (in an event loop thread this module owns), and every
generated request goes over a real connection.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import requests
import schemathesis
from anyio.from_thread import start_blocking_portal
from hypothesis import HealthCheck, settings
from prometheus_client import CollectorRegistry
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from actors.serving.frontend import create_app
from actors.serving.testing import MODEL, FakeBackend
from tests.frontend.conftest import served

# No 5xx, and every response matches the documented status codes, content types and shapes (the
# msgspec encoders against the pydantic documentation models). Not "positive data accepted":
# semantic limits the schema cannot state (context length, min_tokens <= max_tokens, n > 1 not
# supported) rightly answer 400 to schema-valid input.
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
