"""The one door to the generation endpoints: every request to their paths comes in here.

FastAPI takes a request through about ten middleware and routing layers, reads and parses its
body in steps, solves its dependencies, and wraps ``send`` in layers that every streamed chunk
then goes through: a noticeable share of the root's CPU for each request. So the app hands every
request to a generation path to this door before FastAPI sees it. The door reads the body (the
size limit, a client gone while sending), parses it (``json.loads``, when the content type says
JSON; a whole number is an int however it is written), validates it with the endpoint's pydantic
model, and calls the endpoint, whose response runs on the server's own ``send``; every refusal
(405, 413, 400) is rendered here, with :mod:`._errors`. This is the only place that decides what
a valid generation request is. FastAPI serves the other routes and documents these (the OpenAPI
schema, whose request bodies are the same models' own schemas); its router also knows their
paths, so that it redirects a trailing slash to them and hands a mounted app's requests to them
back to this door.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from decimal import Decimal
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ._errors import (
    http_error_response,
    internal_error_response,
    json_error_response,
    validation_error_response,
)
from ._metrics import FrontendMetrics
from ._request_id import Header

__all__ = ["Door", "GenerationRoute"]

M = TypeVar("M", bound=BaseModel)

#: What pydantic says of a required value that is absent: here, the whole body.
_MISSING_BODY: Sequence[Mapping[str, Any]] = (
    {"type": "missing", "loc": (), "msg": "Field required"},
)


class GenerationRoute(Generic[M]):
    """A generation endpoint: its path (``POST``), its body's model, and its handler."""

    __slots__ = ("endpoint", "model", "path")

    def __init__(
        self, path: str, model: type[M], endpoint: Callable[[Request, M], Awaitable[Response]]
    ) -> None:
        self.path = path
        self.model = model
        self.endpoint = endpoint


class _Refused(Exception):
    """The door answers ``response`` instead of calling the endpoint (``None``: the client left,
    there is nobody to answer)."""

    def __init__(self, response: Response | None) -> None:
        self.response = response


class Door:
    """Serves the requests to ``routes``' paths, whatever their method."""

    __slots__ = ("_max_body", "_metrics", "routes")

    def __init__(
        self,
        routes: Iterable[GenerationRoute[Any]],
        max_body_bytes: int,
        metrics: FrontendMetrics,
    ) -> None:
        self.routes = {route.path: route for route in routes}
        self._max_body = max_body_bytes
        self._metrics = metrics

    def route(self, scope: Scope) -> GenerationRoute[Any] | None:
        """The route ``scope`` asks for, if it is one of the door's (cheap: every request asks).

        A mounted app's requests (``root_path``) are left to FastAPI's router, which knows how
        its paths map: its :meth:`entrances` bring them back to this door.
        """
        if scope["type"] != "http" or scope.get("root_path"):
            return None
        return self.routes.get(scope["path"])

    def entrances(self) -> list[Route]:
        """The door's routes for FastAPI's router (out of the schema), for the requests that the
        router sees first: a mounted app's, and a path with a trailing slash (redirected here)."""
        return [
            Route(route.path, _Entrance(self, route), include_in_schema=False)
            for route in self.routes.values()
        ]

    async def serve(
        self,
        route: GenerationRoute[Any],
        scope: Scope,
        receive: Receive,
        send: Send,
        echo: Header | None,
    ) -> None:
        """Serve a request to ``route``, with ``echo`` (its ``x-request-id``) added to whatever
        response it gets (``None``: ``send`` adds it)."""
        try:
            try:
                body = await self._accept(route, scope, receive)
            except _Refused as refused:
                if refused.response is not None:
                    await _echoed(refused.response, echo)(scope, receive, send)
                return
            response = await route.endpoint(Request(scope, receive, send), body)
            await _echoed(response, echo)(scope, receive, send)
        except Exception:
            # What a server-error middleware does: a 500 if nothing was sent yet, and the error
            # goes on to the server, which logs it.
            try:
                await _echoed(internal_error_response(), echo)(scope, receive, send)
            except Exception:
                pass  # the response had started: the server ends the connection
            raise

    async def _accept(self, route: GenerationRoute[M], scope: Scope, receive: Receive) -> M:
        """The request's body, valid for the route's model; raises :class:`_Refused` if not."""
        if scope["method"] != "POST":
            raise _Refused(http_error_response(405, "Method Not Allowed", {"Allow": "POST"}))
        content_type: bytes | None = None
        for name, header in scope["headers"]:
            if name == b"content-type":
                content_type = header
            elif name == b"content-length":
                try:
                    too_large = int(header) > self._max_body
                except ValueError:
                    too_large = False  # the server refuses a malformed length itself
                if too_large:
                    raise _Refused(_too_large())
        body = await self._read(receive)
        if not body:
            raise self._invalid(route, validation_error_response(_MISSING_BODY))
        # A body not declared JSON goes to the model as bytes, which it refuses as not an object.
        value: Any = body
        if content_type is not None and (
            content_type == b"application/json" or _names_json(content_type)
        ):
            try:
                value = json.loads(body, parse_float=_json_number)
            except json.JSONDecodeError as exc:
                raise self._invalid(route, json_error_response(exc.msg)) from None
            except Exception:
                # Bytes in no JSON encoding, or nesting too deep for the parser.
                error = http_error_response(400, "There was an error parsing the body")
                raise _Refused(error) from None
        try:
            # from_attributes: a body that is not an object is refused as
            # "model_attributes_type", the code this API has always answered.
            return route.model.model_validate(value, from_attributes=True)
        except ValidationError as exc:
            errors = exc.errors(include_url=False)
            raise self._invalid(route, validation_error_response(errors)) from None

    async def _read(self, receive: Receive) -> bytes:
        """The whole body; raises :class:`_Refused` past the size limit or if the client left."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise _Refused(None)  # the client left while sending
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self._max_body:
                raise _Refused(_too_large())
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _invalid(self, route: GenerationRoute[Any], response: Response) -> _Refused:
        """A body that is not a valid request: counted as a validation error, then refused."""
        self._metrics.start(route.path).done("error", "validation")
        return _Refused(response)


class _Entrance:
    """One of the door's routes as an ASGI app (an instance, not a function, so that Starlette's
    ``Route`` passes it the request as it is, whatever its method)."""

    __slots__ = ("_door", "_route")

    def __init__(self, door: Door, route: GenerationRoute[Any]) -> None:
        self._door = door
        self._route = route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The router's requests came through the app's echoing send: no header of our own.
        await self._door.serve(self._route, scope, receive, send, None)


def _echoed(response: Response, echo: Header | None) -> Response:
    """``response`` with the ``echo`` header (an SSE response adds it to what it sends)."""
    if echo is not None:
        response.raw_headers.append(echo)
    return response


def _json_number(text: str) -> int | float:
    """A JSON number written with a fraction or an exponent: an int when it is whole, as JSON
    Schema counts integers (``8.0`` is one), where the strict models take only an int."""
    value = float(text)
    if not value.is_integer():
        return value  # inf too: an exponent too large for a float is no int either
    # Exactly, not as the float rounded it: 2**64 - 1 written ``18446744073709551615.0`` is whole
    # and in range, ``8.0000000000000001`` is not whole.
    exact = Decimal(text)
    return int(exact) if exact == exact.to_integral_value() else value


def _too_large() -> Response:
    return http_error_response(413, "Content Too Large")


def _names_json(content_type: bytes) -> bool:
    """Whether a Content-Type other than the plain ``application/json`` still names JSON:
    ``application/json`` or ``application/<anything>+json``, with any parameters, in any case."""
    media = content_type.decode("latin-1").partition(";")[0].strip().lower()
    if media.count("/") != 1:
        return False
    kind, _, subtype = media.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))
