"""Typed request errors: the three ways a request ends badly, never confused.

1. The client cancelled: :class:`RequestCancelled` (never migrated).
2. The worker is shutting down or draining: :class:`WorkerDraining`, :class:`EngineShutdown`
   (migratable).
3. The engine or the transport failed: :class:`EngineFailure`, :class:`EmptyOutput`,
   :class:`StreamStalled`, :class:`StreamIncomplete`, :class:`KVTransferError` (migratable).

Every error carries a stable ``code`` (a dotted reason in the spirit of Dynamo's error chain) so
it crosses process boundaries intact: :func:`error_from_wire` rebuilds the same class from
``(code, message)``.

The hierarchy (a class subclasses the nearest less indented one above it), each with the HTTP
status the frontend answers with, ``migratable`` where a request stream may re-dispatch the
request to another worker, and its wire code::

    RequestError                   500              internal
        RequestCancelled           499              request.cancelled
        InvalidRequest             400              request.invalid
            ContextLengthExceeded  400              request.context_length_exceeded
        ModelNotFound              404              request.model_not_found
        Overloaded                 503              capacity.exhausted
        NoWorkerAvailable          503              capacity.no_worker
        RequestTimeout             504              request.timeout
        MigrationExhausted         500              request.migration_exhausted
        WorkerDraining             503  migratable  backend.worker_draining
        EngineShutdown             503  migratable  backend.engine_shutdown
        EngineFailure              500  migratable  backend.engine_failure
            EmptyOutput            500  migratable  backend.empty_output
        StreamStalled              500  migratable  backend.response_timeout
        StreamIncomplete           500  migratable  backend.stream_incomplete
        KVTransferError            500  migratable  kv.transfer_failed
            KVCorrupted            500  migratable  kv.corrupted

The serving application adds a few subclasses (its KV transfer's, drawn in
:mod:`actors.serving.errors`); the codec's own errors are :class:`protocols.codec.ProtocolError`.
"""

from __future__ import annotations

from typing import ClassVar

from protocols import codec

__all__ = [
    "ContextLengthExceeded",
    "EmptyOutput",
    "EngineFailure",
    "EngineShutdown",
    "InvalidRequest",
    "KVCorrupted",
    "KVTransferError",
    "MigrationExhausted",
    "ModelNotFound",
    "NoWorkerAvailable",
    "Overloaded",
    "RequestCancelled",
    "RequestError",
    "RequestTimeout",
    "StreamIncomplete",
    "StreamStalled",
    "WorkerDraining",
    "error_from_wire",
]


class RequestError(Exception):
    """Base of every error that ends one request.

    ``migratable`` says whether the request-stream actor may re-dispatch the request to another
    worker; ``http_status`` is the status the OpenAI frontend answers with.
    """

    code: ClassVar[str] = "internal"
    migratable: ClassVar[bool] = False
    http_status: ClassVar[int] = 500

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.code)
        self.message = message or self.code

    def to_wire(self) -> tuple[str, str]:
        """The ``(code, message)`` pair that crosses a process boundary."""
        return self.code, self.message


class RequestCancelled(RequestError):
    """The client went away or asked to stop; the engine request was aborted."""

    code = "request.cancelled"
    http_status = 499


class InvalidRequest(RequestError):
    """The request is malformed or violates a limit; nothing was run."""

    code = "request.invalid"
    http_status = 400


class ContextLengthExceeded(InvalidRequest):
    """Prompt plus requested tokens exceed the model's context length."""

    code = "request.context_length_exceeded"


class ModelNotFound(RequestError):
    """No model of that name is served."""

    code = "request.model_not_found"
    http_status = 404


class Overloaded(RequestError):
    """Admission refused for lack of capacity; retry later."""

    code = "capacity.exhausted"
    http_status = 503


class NoWorkerAvailable(RequestError):
    """No routable worker exists right now (all starting, draining or unhealthy)."""

    code = "capacity.no_worker"
    http_status = 503


class RequestTimeout(RequestError):
    """The per-request deadline passed."""

    code = "request.timeout"
    http_status = 504


class MigrationExhausted(RequestError):
    """A migratable error happened but the migration limit was reached."""

    code = "request.migration_exhausted"
    http_status = 500


class WorkerDraining(RequestError):
    """The worker stopped admitting requests (drain, shutdown, memory release)."""

    code = "backend.worker_draining"
    migratable = True
    http_status = 503


class EngineShutdown(RequestError):
    """The worker shut down while the request ran; the engine request was aborted."""

    code = "backend.engine_shutdown"
    migratable = True
    http_status = 503


class EngineFailure(RequestError):
    """The engine died, crashed or failed the request."""

    code = "backend.engine_failure"
    migratable = True


class EmptyOutput(EngineFailure):
    """A block-diffusion (``dllm``) model's output had neither tokens nor a finish reason: its
    block never came (a chat model's request stream skips such an output instead)."""

    code = "backend.empty_output"


class StreamStalled(RequestError):
    """No output arrived within the stream's inactivity timeout."""

    code = "backend.response_timeout"
    migratable = True


class StreamIncomplete(RequestError):
    """The output stream ended without a terminal item."""

    code = "backend.stream_incomplete"
    migratable = True


class KVTransferError(RequestError):
    """The KV transfer between prefill and decode failed or timed out."""

    code = "kv.transfer_failed"
    migratable = True


class KVCorrupted(KVTransferError):
    """Received KV pages failed verification."""

    code = "kv.corrupted"


def _all_subclasses(cls: type[RequestError]) -> list[type[RequestError]]:
    out: list[type[RequestError]] = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


def error_from_wire(code: str, message: str) -> RequestError:
    """Rebuild the typed error sent as ``(code, message)``; unknown codes stay readable."""
    for cls in _all_subclasses(RequestError):
        if cls.code == code:
            return cls(message)
    err = RequestError(f"{code}: {message}")
    return err


codec.register_error_family("request", RequestError, RequestError.to_wire, error_from_wire)
