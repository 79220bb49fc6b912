"""Errors in OpenAI's format: ``{"error": {"message", "type", "param", "code"}}``.

Typed request errors (:mod:`protocols.errors`) keep their ``http_status``; a body that is not
JSON or not valid for its model gets a 400, like OpenAI's; HTTP-level refusals (wrong method, body
too large, unknown route) keep their status; 429 and 503 carry ``Retry-After``. Every refusal the
frontend sends is rendered here.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from protocols.errors import (
    ContextLengthExceeded,
    EngineShutdown,
    InvalidRequest,
    ModelNotFound,
    NoWorkerAvailable,
    Overloaded,
    RequestCancelled,
    RequestError,
    RequestTimeout,
    StreamIncomplete,
    StreamStalled,
    WorkerDraining,
)

__all__ = [
    "error_body",
    "error_payload",
    "error_response",
    "error_type_label",
    "http_error_response",
    "http_exception_response",
    "internal_error_handler",
    "internal_error_response",
    "invalid",
    "json_error_response",
    "validation_error_response",
]

log = logging.getLogger("actorserve.frontend")

# OpenAI's well-known codes where one exists; otherwise the typed error's own dotted code.
_OPENAI_CODES: dict[type[RequestError], str] = {
    ModelNotFound: "model_not_found",
    ContextLengthExceeded: "context_length_exceeded",
}

_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    503: "service_unavailable",
    504: "timeout",
}


def invalid(message: str, param: str | None = None) -> InvalidRequest:
    """An :class:`InvalidRequest` that names the offending request field."""
    exc = InvalidRequest(message)
    setattr(exc, "param", param)  # noqa: B010  (RequestError has no param slot; read by getattr)
    return exc


def error_body(status: int, message: str, code: str | None, param: str | None = None) -> bytes:
    """The JSON error object; ``ensure_ascii`` so any text at all can be sent back."""
    err = {
        "message": message,
        "type": _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
        "param": param,
        "code": code,
    }
    return json.dumps({"error": err}).encode()


def _retry_headers(status: int, retry_after_s: int) -> dict[str, str]:
    return {"Retry-After": str(retry_after_s)} if status in (429, 503) else {}


def error_payload(exc: RequestError) -> bytes:
    """The OpenAI error object for a typed request error (a body, or an SSE error event)."""
    code = _OPENAI_CODES.get(type(exc), exc.code)
    return error_body(exc.http_status, exc.message, code, getattr(exc, "param", None))


def error_response(exc: RequestError, *, retry_after_s: int = 1) -> Response:
    """The HTTP response for a typed request error raised before any byte of the body was sent.

    ``Retry-After`` (on 429 and 503) is the error's own ``retry_after_s`` attribute if it has one,
    else ``retry_after_s``.
    """
    status = exc.http_status
    retry = getattr(exc, "retry_after_s", None)
    headers = _retry_headers(status, retry_after_s if retry is None else int(retry))
    return Response(
        error_payload(exc), status_code=status, headers=headers, media_type="application/json"
    )


def error_type_label(exc: BaseException) -> str:
    """The ``error_type`` metric label, in the spirit of Dynamo's frontend error types."""
    if isinstance(exc, InvalidRequest):
        return "validation"
    if isinstance(exc, ModelNotFound):
        return "not_found"
    if isinstance(exc, Overloaded):
        return "overload"
    if isinstance(exc, (NoWorkerAvailable, WorkerDraining, EngineShutdown)):
        return "unavailable"
    if isinstance(exc, RequestCancelled):
        return "cancelled"
    if isinstance(exc, (RequestTimeout, StreamStalled)):
        return "response_timeout"
    if isinstance(exc, StreamIncomplete):
        return "truncated_stream"
    if isinstance(exc, RequestError):
        return "backend_error"
    return "internal"


def _param(loc: tuple[int | str, ...]) -> str | None:
    return ".".join(str(p) for p in loc) or None


def json_error_response(detail: str) -> Response:
    """400 for a body declared JSON that does not parse; ``detail`` says where it fails."""
    return _bad_request(f"Invalid JSON body: {detail}", "json_invalid", None)


def validation_error_response(errors: Sequence[Mapping[str, Any]]) -> Response:
    """A body its model refused (pydantic's errors, the first one first) as OpenAI's 400: the
    first problem, the field it concerns, and a count."""
    first = errors[0]
    param = _param(tuple(first.get("loc", ())))
    msg = str(first.get("msg", "invalid value"))
    message = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        message = f"{message} (and {len(errors) - 1} more problems)"
    return _bad_request(message, str(first.get("type", "invalid_value")), param)


def _bad_request(message: str, code: str, param: str | None) -> Response:
    return Response(
        error_body(400, message, code, param), status_code=400, media_type="application/json"
    )


def http_error_response(
    status: int, message: str, headers: Mapping[str, str] | None = None
) -> Response:
    """An HTTP-level refusal (unknown route, wrong method, a body too large or unreadable)."""
    return Response(
        error_body(status, message, None),
        status_code=status,
        headers=dict(headers or {}),
        media_type="application/json",
    )


def http_exception_response(exc: HTTPException) -> Response:
    """Starlette's own HTTP errors (unknown route, wrong method) in OpenAI's format."""
    return http_error_response(exc.status_code, str(exc.detail), exc.headers)


def internal_error_response() -> Response:
    """500 for a failure of ours: the details go to the log, never to the client."""
    return Response(
        error_body(500, "internal server error", "internal"),
        status_code=500,
        media_type="application/json",
    )


async def internal_error_handler(request: Request, exc: Exception) -> Response:
    """Anything unexpected that escaped a route: logged with its traceback, answered 500."""
    log.error("unhandled error on %s", request.url.path, exc_info=exc)
    return internal_error_response()
