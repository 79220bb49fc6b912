"""Errors in OpenAI's format: ``{"error": {"message", "type", "param", "code"}}``.

Typed request errors (:mod:`protocols.errors`) keep their ``http_status``; FastAPI's validation
errors (422 by default) become 400, like OpenAI's; 429 and 503 carry ``Retry-After``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi.exceptions import RequestValidationError
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
    "http_exception_response",
    "internal_error_handler",
    "internal_error_response",
    "invalid",
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
    if isinstance(exc, (InvalidRequest, RequestValidationError)):
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
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


def validation_error_response(exc: RequestValidationError) -> Response:
    """FastAPI's 422 as OpenAI's 400: the first problem, the field it concerns, and a count."""
    errors: list[dict[str, Any]] = list(exc.errors())
    if not errors:
        return Response(
            error_body(400, "invalid request", "invalid_request"),
            status_code=400,
            media_type="application/json",
        )
    first = errors[0]
    kind = str(first.get("type", "invalid_value"))
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "malformed JSON")
        message, param = f"Invalid JSON body: {detail}", None
    else:
        param = _param(tuple(first.get("loc", ())))
        msg = str(first.get("msg", "invalid value"))
        message = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        message = f"{message} (and {len(errors) - 1} more problems)"
    return Response(
        error_body(400, message, kind, param), status_code=400, media_type="application/json"
    )


def http_exception_response(exc: HTTPException) -> Response:
    """Starlette's own HTTP errors (unknown route, wrong method) in OpenAI's format."""
    headers = dict(exc.headers or {})
    return Response(
        error_body(exc.status_code, str(exc.detail), None),
        status_code=exc.status_code,
        headers=headers,
        media_type="application/json",
    )


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
