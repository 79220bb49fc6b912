"""A direct path to the generation endpoints for well-formed requests.

FastAPI takes a request through about ten middleware and routing layers, reads and parses its
body in steps, solves its dependencies, and wraps ``send`` in five layers that every streamed
chunk then goes through: about a tenth of the root's CPU per request (measured). A ``POST`` to a
generation path whose body is JSON (``application/json``), within the size limit, and valid for
the endpoint's pydantic model takes this path instead: the same parse (``json.loads``), the same
validation, the same endpoint, and its response runs on the server's own ``send``. Every other
request, and every body this path would refuse, goes to FastAPI with the body replayed, so all
errors (413, 400, 422-as-400, content type, a client gone while sending) keep FastAPI's
behaviour exactly.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._errors import internal_error_response

__all__ = ["DirectRoute", "FastPath"]

Endpoint = Callable[[Request, Any], Awaitable[Response]]


class DirectRoute:
    """A generation endpoint: its body model and handler (FastAPI's route stays registered, for
    the requests that take the full path and for the OpenAPI schema)."""

    __slots__ = ("endpoint", "model")

    def __init__(self, model: type[BaseModel], endpoint: Endpoint) -> None:
        self.model = model
        self.endpoint = endpoint


class FastPath:
    """Serves ``routes`` (``POST`` paths) directly; falls back to ``app`` for anything else."""

    __slots__ = ("_app", "_max_body", "routes")

    def __init__(self, app: ASGIApp, routes: dict[str, DirectRoute], max_body_bytes: int) -> None:
        self._app = app
        self._max_body = max_body_bytes
        self.routes = routes

    def route(self, scope: Scope) -> DirectRoute | None:
        """The route ``scope`` may take directly, if any (cheap: every request asks)."""
        if scope["type"] != "http" or scope["method"] != "POST" or scope.get("root_path"):
            return None
        return self.routes.get(scope["path"])

    async def serve(self, route: DirectRoute, scope: Scope, receive: Receive, send: Send) -> None:
        received: list[Message] = []
        body = await self._read_body(scope, receive, received)
        parsed: BaseModel | None = None
        if body:
            try:
                # As FastAPI: json.loads on the bytes, then the model's own validation.
                parsed = route.model.model_validate(json.loads(body))
            except (ValueError, ValidationError):
                parsed = None  # FastAPI answers it (JSONDecodeError is a ValueError)
        if parsed is None:
            await self._app(scope, _replay(received, receive), send)
            return
        try:
            response = await route.endpoint(Request(scope, receive, send), parsed)
            await response(scope, receive, send)
        except Exception:
            # What FastAPI's outermost middleware does: a 500 if nothing was sent yet, and the
            # error goes on to the server, which logs it.
            try:
                await internal_error_response()(scope, receive, send)
            except Exception:
                pass  # the response had started: the server ends the connection
            raise

    async def _read_body(
        self, scope: Scope, receive: Receive, received: list[Message]
    ) -> bytes | None:
        """The whole body if this path may serve it, else ``None``; what was read is kept in
        ``received`` for FastAPI."""
        json_body = False
        for name, value in scope["headers"]:
            if name == b"content-type":
                json_body = value.split(b";", 1)[0].strip().lower() == b"application/json"
            elif name == b"content-length":
                try:
                    if int(value) > self._max_body:
                        return None
                except ValueError:
                    return None
        if not json_body:
            return None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            received.append(message)
            if message["type"] != "http.request":
                return None  # the client left while sending
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self._max_body:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(received: list[Message], receive: Receive) -> Receive:
    """``receive`` that first gives back the messages already read."""
    pending = list(received)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
