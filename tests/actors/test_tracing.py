"""``actors.tracing``: off until configured, the client's W3C trace context as the parent,
parent-based ratio sampling, and the OTLP/HTTP exporter's URL."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from actors import tracing

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
SAMPLED = f"00-{TRACE_ID}-b7ad6b7169203331-01"
NOT_SAMPLED = f"00-{TRACE_ID}-b7ad6b7169203331-00"


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    yield exporter
    tracing.shutdown_tracing()


def test_off_until_configured_and_after_shutdown(exporter: InMemorySpanExporter) -> None:
    assert tracing.tracer() is None
    tracing.configure_tracing(processor=SimpleSpanProcessor(exporter))
    assert tracing.tracer() is not None
    tracing.shutdown_tracing()
    assert tracing.tracer() is None
    tracing.shutdown_tracing()  # a no-op while off


def test_the_clients_traceparent_is_the_parent(exporter: InMemorySpanExporter) -> None:
    tracing.configure_tracing(processor=SimpleSpanProcessor(exporter))
    tracer = tracing.tracer()
    assert tracer is not None
    token = tracing.attach_headers([(b"traceparent", SAMPLED.encode()), (b"accept", b"*/*")])
    try:
        span = tracer.start_span("request", context=tracing.current_context())
    finally:
        tracing.detach(token)
    child = tracer.start_span("attempt", context=tracing.context_of(span))
    traceparent = tracing.traceparent_of(child)
    tracing.mark_error(child, "backend.engine_failure", "killed")
    child.end()
    span.end()
    finished = {s.name: s for s in exporter.get_finished_spans()}
    request, attempt = finished["request"], finished["attempt"]
    assert request.parent is not None and request.parent.span_id == int(SAMPLED[36:52], 16)
    assert request.context.trace_id == int(TRACE_ID, 16)
    assert attempt.parent is not None and attempt.parent.span_id == request.context.span_id
    assert traceparent == f"00-{TRACE_ID}-{attempt.context.span_id:016x}-01"
    assert attempt.attributes is not None
    assert attempt.attributes["error.type"] == "backend.engine_failure"
    assert not attempt.status.is_ok


def test_the_ratio_samples_new_traces_and_follows_a_clients_decision(
    exporter: InMemorySpanExporter,
) -> None:
    tracing.configure_tracing(sample_ratio=0.0, processor=SimpleSpanProcessor(exporter))
    tracer = tracing.tracer()
    assert tracer is not None
    for traceparent, recorded in ((None, False), (SAMPLED, True), (NOT_SAMPLED, False)):
        headers = [] if traceparent is None else [(b"traceparent", traceparent.encode())]
        token = tracing.attach_headers(headers)
        try:
            span = tracer.start_span("request", context=tracing.current_context())
        finally:
            tracing.detach(token)
        assert span.is_recording() is recorded, traceparent
        span.end()
    assert len(exporter.get_finished_spans()) == 1


@pytest.mark.parametrize("ratio", [-0.1, 1.5, float("nan")])
def test_a_bad_sample_ratio_is_refused(ratio: float) -> None:
    with pytest.raises(ValueError, match="from 0 to 1"):
        tracing.configure_tracing("http://127.0.0.1:4318", ratio)
    assert tracing.tracer() is None


def test_an_otlp_endpoint_is_the_collectors_base_url() -> None:
    assert tracing.traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert tracing.traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert tracing.traces_url("http://c:4318/v1/traces") == "http://c:4318/v1/traces"
    with pytest.raises(ValueError, match="endpoint"):
        tracing.configure_tracing()


def test_the_otlp_exporter_is_set_up_and_shut_down() -> None:
    # Nothing is sent: no span is made before the shutdown.
    tracing.configure_tracing("http://127.0.0.1:9/", 0.5)
    try:
        assert tracing.tracer() is not None
    finally:
        tracing.shutdown_tracing()
    assert tracing.tracer() is None


def test_a_missing_sdk_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    tracing.check_installed()  # the dev extra has them
    real = importlib.util.find_spec

    def without_sdk(name: str, package: str | None = None) -> Any:
        return None if name == "opentelemetry.sdk" else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", without_sdk)
    with pytest.raises(ValueError, match=r"sdk: pip install 'actorserve\[tracing\]'"):
        tracing.check_installed()
