"""What the benchmarks' light clients share: a streamed completion over ``http.client``."""

from __future__ import annotations

import http.client
import json

HEADERS = {"content-type": "application/json"}


def completion_body(prompt: str, max_tokens: int) -> bytes:
    """A streamed, greedy ``/v1/completions`` request for the mock model."""
    body = {
        "model": "mock",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    return json.dumps(body).encode()


def post_stream(conn: http.client.HTTPConnection, body: bytes) -> http.client.HTTPResponse:
    """Send ``body`` (headers and body in one send: ``http.client`` joins them) and return the
    response, its status 200, to read the events from."""
    conn.request("POST", "/v1/completions", body, HEADERS)
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
    return response
