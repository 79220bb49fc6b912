"""OpenTelemetry tracing, opt-in: :func:`configure_tracing` sets it up for this process; until
then :func:`tracer` is ``None`` and nothing of OpenTelemetry's SDK is imported.

Callers check ``tracer() is not None`` before anything else here: the helpers below import
OpenTelemetry (installed with ``actorserve[tracing]``) on their first call, which only a process
with tracing on makes. The spans go to an OTLP/HTTP collector through a batching processor;
the SDK's ``OTEL_*`` variables (``OTEL_EXPORTER_OTLP_HEADERS``, ``OTEL_SERVICE_NAME``, ...)
apply. The process's global tracer provider is left alone: an embedding application keeps its
own.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from contextvars import Token

    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    from opentelemetry.trace import Span, Tracer

__all__ = [
    "attach_headers",
    "check_installed",
    "check_sample_ratio",
    "configure_tracing",
    "context_of",
    "current_context",
    "detach",
    "mark_error",
    "shutdown_tracing",
    "traceparent_of",
    "tracer",
    "traces_url",
]

_tracer: Tracer | None = None
_provider: TracerProvider | None = None
_SERVICE = "actorserve"
_TRACES_PATH = "/v1/traces"


def tracer() -> Tracer | None:
    """This process's tracer, or ``None`` while tracing is off (the one check a hot path
    makes)."""
    return _tracer


def check_sample_ratio(ratio: float) -> float:
    """``ratio`` if it is a fraction of traces to keep (0 to 1), else ``ValueError``."""
    if not (isinstance(ratio, int | float) and 0.0 <= ratio <= 1.0 and not math.isnan(ratio)):
        raise ValueError(f"trace sample ratio {ratio!r}: expected a number from 0 to 1")
    return float(ratio)


def check_installed() -> None:
    """Raise ``ValueError`` (saying how to install them) where the SDK or its OTLP exporter is
    missing; imports neither."""
    for module in ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a parent package is missing
            found = False
        if not found:
            raise ValueError(f"tracing needs {module}: pip install 'actorserve[tracing]'")


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector's base ``endpoint`` (``http://host:4318``), as
    the SDK derives it from ``OTEL_EXPORTER_OTLP_ENDPOINT``; a full traces URL is kept."""
    base = endpoint.rstrip("/")
    return base if base.endswith(_TRACES_PATH) else base + _TRACES_PATH


def configure_tracing(
    endpoint: str | None = None,
    sample_ratio: float = 1.0,
    *,
    processor: SpanProcessor | None = None,
) -> None:
    """Trace this process's requests: spans go to the OTLP/HTTP collector at ``endpoint`` (its
    base URL, see :func:`traces_url`), or to ``processor`` (a test's in-memory exporter).

    ``sample_ratio`` of the traces that start here are kept (a request whose client sent a
    ``traceparent`` follows its sampling decision). A second call replaces the first setup.
    """
    global _tracer, _provider
    ratio = check_sample_ratio(sample_ratio)
    if processor is None:
        if not endpoint:
            raise ValueError("tracing needs an OTLP endpoint or a span processor")
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint)))
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    resource = Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        # OTEL_SERVICE_NAME (or a service.name in OTEL_RESOURCE_ATTRIBUTES) names it otherwise.
        resource = resource.merge(Resource({"service.name": _SERVICE}))
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(ratio)))
    provider.add_span_processor(processor)
    shutdown_tracing()
    _provider, _tracer = provider, provider.get_tracer(_SERVICE)


def shutdown_tracing() -> None:
    """Send the spans still buffered and turn tracing off (a no-op while it is off)."""
    global _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


def attach_headers(headers: Iterable[tuple[bytes, bytes]]) -> Token[Context]:
    """Make the W3C trace context of a request's HTTP ``headers`` (``traceparent``,
    ``tracestate``) the current one in this task; :func:`detach` the token it returns."""
    from opentelemetry import context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {
        name.decode("latin-1"): value.decode("latin-1")
        for name, value in headers
        if name in (b"traceparent", b"tracestate")
    }
    return context.attach(TraceContextTextMapPropagator().extract(carrier))


def detach(token: Token[Context]) -> None:
    """Undo :func:`attach_headers` (in the task that attached)."""
    from opentelemetry import context

    context.detach(token)


def current_context() -> Context:
    """The trace context of this task (the client's, where :func:`attach_headers` set it)."""
    from opentelemetry import context

    return context.get_current()


def context_of(span: Span) -> Context:
    """A context whose current span is ``span``: the parent of its children."""
    from opentelemetry import trace

    return trace.set_span_in_context(span)


def traceparent_of(span: Span) -> str | None:
    """``span``'s W3C ``traceparent`` header, for a process it continues in (``None`` for a
    span with no valid context)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context_of(span))
    return carrier.get("traceparent")


def mark_error(span: Span, error_type: str, message: str) -> None:
    """Mark ``span`` failed with ``error_type`` (OpenTelemetry's ``error.type``)."""
    from opentelemetry.trace import StatusCode

    span.set_attribute("error.type", error_type)
    span.set_status(StatusCode.ERROR, message)
