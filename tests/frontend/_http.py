"""Helpers of the HTTP tests: SSE parsing and raw-socket requests."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

import anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def sse_events(body: str) -> list[tuple[str | None, str]]:
    """``(event name, data)`` of each event in an SSE body (comments skipped)."""
    events: list[tuple[str | None, str]] = []
    for block in body.split("\n\n"):
        name, data = None, []
        for line in block.splitlines():
            if line.startswith("event:"):
                name = line.removeprefix("event:").strip()
            elif line.startswith("data:"):
                data.append(line.removeprefix("data:").strip())
        if data:
            events.append((name, "\n".join(data)))
    return events


def chunks(body: str) -> list[dict[str, Any]]:
    """The JSON chunks of a stream, checking it ends with ``[DONE]`` and has no error event."""
    events = sse_events(body)
    assert events[-1] == (None, "[DONE]")
    assert all(name is None for name, _ in events), events
    return [json.loads(data) for _, data in events[:-1]]


def chat_body(content: str = "hi", **fields: Any) -> dict[str, Any]:
    return {"model": "mock-model", "messages": [{"role": "user", "content": content}], **fields}


async def open_raw_stream(base_url: str, path: str, body: dict[str, Any]) -> anyio.abc.SocketStream:
    """POST ``body`` over a raw TCP connection and return it (the response is left unread)."""
    url = urlsplit(base_url)
    assert url.hostname is not None and url.port is not None
    stream = await anyio.connect_tcp(url.hostname, url.port)
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    await stream.send(head + payload)
    return stream


async def read_until(stream: anyio.abc.SocketStream, marker: bytes) -> bytes:
    """Receive until ``marker`` was seen; everything received so far."""
    data = b""
    while marker not in data:
        data += await stream.receive()
    return data
