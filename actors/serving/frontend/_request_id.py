"""A request's id: the client's ``x-request-id`` (or one made here), echoed in its response and
bound in ``structlog.contextvars`` as ``request_id`` for every line logged while serving it."""

from __future__ import annotations

import re
import secrets
from collections.abc import MutableMapping
from typing import Any

from starlette.types import Scope, Send

__all__ = ["Header", "echoing", "request_id_of"]

Header = tuple[bytes, bytes]

# A client's id is kept if it is printable ASCII and short: it goes into every log line as is.
_VALID = re.compile(rb"[ -~]{1,128}")


def request_id_of(scope: Scope) -> bytes:
    """The client's ``x-request-id`` if valid (printable ASCII, 1 to 128 characters), else a
    new one (32 hex digits)."""
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            if _VALID.fullmatch(value):
                return bytes(value)
            break
    return secrets.token_hex(16).encode()


def echoing(send: Send, header: Header) -> Send:
    """``send``, with ``header`` added to the response's start (for the routes off the hot
    path: every message of the response goes through it)."""

    async def echo(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), header]}
        await send(message)

    return echo
