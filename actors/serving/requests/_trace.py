"""A request's trace, while tracing is on (:func:`actors.tracing.tracer`).

One span for the request's life in the root (``actorserve.request``: from admission to its last
chunk, the client's ``traceparent`` its parent), with the events of that life (the first token,
each migration) and, as its children, one span per attempt (``actorserve.attempt``: a worker's
stream, its role and worker id); a disaggregated attempt has the prefill's own span and the KV
transfer's, as far as the root sees it (from the prefill's first token to the decode worker's
repeat of it), under it. Each engine request carries its span's ``traceparent``, so an engine
that traces (SGLang's ``external_trace_header``) continues the trace.

With tracing off, none of these exist: the request stream, its attempts and its consumer hold
``None`` and check that alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from actors.tracing import context_of, mark_error, traceparent_of
from protocols.engine import EngineOutput, PreprocessedRequest
from protocols.errors import EngineFailure, RequestError

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer

__all__ = ["AttemptTrace", "RequestTrace", "end_span"]


class RequestTrace:
    """The span of one request in the root, and the attempts under it."""

    __slots__ = ("_attempts", "_tracer", "span")

    def __init__(
        self,
        tracer: Tracer,
        parent: Context,
        start_ns: int,
        request: PreprocessedRequest,
        *,
        model: str,
        request_id: str | None,
    ) -> None:
        self._tracer = tracer
        self._attempts = 0
        attributes: dict[str, str | int] = {
            "gen_ai.request.model": model,
            "actorserve.rid": request.rid,
            "gen_ai.usage.input_tokens": len(request.token_ids),
        }
        if request_id is not None:
            attributes["actorserve.request_id"] = request_id
        self.span = tracer.start_span(
            "actorserve.request", context=parent, start_time=start_ns, attributes=attributes
        )

    def attempt(self, request: PreprocessedRequest, *, prepared: bool = False) -> AttemptTrace:
        """A new attempt's span (its worker is set once routed)."""
        self._attempts += 1
        span = self._tracer.start_span(
            "actorserve.attempt",
            context=context_of(self.span),
            attributes={
                "actorserve.attempt": self._attempts,
                "actorserve.rid": request.rid,
                "actorserve.live_migration": request.live_migration,
                "actorserve.prepared": prepared,
            },
        )
        return AttemptTrace(self._tracer, span)

    def first_token(self) -> None:
        self.span.add_event("first_token")

    def migration(
        self, error: RequestError, worker: str | None, generated: int, *, live: bool
    ) -> None:
        """The request goes on elsewhere after ``error`` on ``worker``."""
        attributes: dict[str, str | int | bool] = {
            "reason": error.code,
            "generated_tokens": generated,
            "live": live,
        }
        if worker is not None:
            attributes["worker_id"] = worker
        self.span.add_event("migration", attributes)

    def fallback(self, error: RequestError) -> None:
        """A live migration failed before its first output: it replays the tokens instead."""
        self.span.add_event("live_migration_fallback", {"reason": error.code})

    def finished(self, output: EngineOutput) -> None:
        """The terminal output: its finish reason and the request's token counts."""
        span = self.span
        span.set_attribute("gen_ai.response.finish_reasons", (output.finish_reason or "",))
        usage = output.usage
        if usage is not None:
            span.set_attribute("gen_ai.usage.output_tokens", usage.completion_tokens)
            if usage.cached_tokens is not None:
                span.set_attribute("actorserve.usage.cached_tokens", usage.cached_tokens)
        if output.finish_reason == "error":
            mark_error(span, EngineFailure.code, output.error or "the engine failed the request")

    def end(self, error: RequestError | None = None, *, cancelled: bool = False) -> None:
        """The request is over (once): ended by ``error``, cancelled by its client, or done."""
        span = self.span
        span.set_attribute("actorserve.attempts", self._attempts)
        if error is not None:
            mark_error(span, error.code, error.message)
        elif cancelled:
            # The client's choice, not a failure (as a 4xx is none for an HTTP server's span).
            span.set_attribute("actorserve.cancelled", True)
        span.end()


class AttemptTrace:
    """One attempt's span, with its prefill's and KV transfer's where disaggregated."""

    __slots__ = ("_kv", "_tracer", "span")

    def __init__(self, tracer: Tracer, span: Span) -> None:
        self._tracer = tracer
        self.span = span
        self._kv: Span | None = None

    def carry(self, request: PreprocessedRequest) -> PreprocessedRequest:
        """``request`` with this attempt's trace context, for the engine it goes to."""
        return msgspec.structs.replace(request, traceparent=traceparent_of(self.span))

    def routed(self, worker_id: str, role: str) -> None:
        self.span.set_attributes({"actorserve.worker_id": worker_id, "actorserve.role": role})

    def prefill(
        self, worker_id: str, request: PreprocessedRequest
    ) -> tuple[Span, PreprocessedRequest]:
        """The span of this attempt's prefill on ``worker_id``, and ``request`` carrying it."""
        boot = request.bootstrap_info
        span = self._tracer.start_span(
            "actorserve.prefill",
            context=context_of(self.span),
            attributes={
                "actorserve.worker_id": worker_id,
                "actorserve.role": "prefill",
                "actorserve.rid": request.rid,
                "actorserve.bootstrap_room": -1 if boot is None else boot.room,
            },
        )
        return span, msgspec.structs.replace(request, traceparent=traceparent_of(span))

    def kv_transfer(self) -> None:
        """The prefill's first token is here: its KV goes to the decode worker from now on."""
        self._kv = self._tracer.start_span("actorserve.kv_transfer", context=context_of(self.span))

    def kv_transferred(self, error: BaseException | None = None) -> None:
        """The decode worker went on from the prefill's KV (or ``error`` says it did not)."""
        kv, self._kv = self._kv, None
        if kv is not None:
            end_span(kv, error)

    def end(self, error: BaseException | None = None) -> None:
        """The attempt is over, ended by ``error`` (a request error or the worker's death)."""
        self.kv_transferred(error)
        end_span(self.span, error)


def end_span(span: Span, error: BaseException | None = None) -> None:
    """End ``span``, failed with ``error`` if there is one (a prefill's ends with its stream,
    where the KV transfer reached its end)."""
    if error is not None:
        mark_error(span, _code(error), str(error))
    span.end()


def _code(error: BaseException) -> str:
    # Anything else that ends an attempt is the engine actor's death: a failure of the worker.
    return error.code if isinstance(error, RequestError) else EngineFailure.code
