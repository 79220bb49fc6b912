"""Tracing through a real serving tree (mock engines in child processes): one span per request
under the client's ``traceparent``, an attempt span per worker's stream (two, and a migration
event, after a SIGKILL mid-stream), the prefill and the KV transfer of a disaggregated request,
a cancel that is no error; a root started with ``--otlp-endpoint`` sends them to its collector;
with tracing off, no SDK at all; and the options' checks."""

from __future__ import annotations

import gzip
import http.server
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from typer.testing import CliRunner

from actors import tracing
from actors.lowlevel import free_port
from actors.serving.cli import app
from actors.serving.root import load_config
from protocols import codec
from protocols.engine import PreprocessedRequest
from tests.helpers.serving import serving_tree, start_root
from tests.serving.test_e2e import _stream_text
from tests.serving.test_json_logs import _wait_healthy

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.configure_tracing(processor=SimpleSpanProcessor(exporter))
    yield exporter
    tracing.shutdown_tracing()


async def _requests(exporter: InMemorySpanExporter, n: int) -> list[ReadableSpan]:
    """The first ``n`` request spans, once ended (the stream actor ends its span once the
    consumer closed the request, just after the response)."""
    with anyio.fail_after(30):
        while True:
            found = [s for s in exporter.get_finished_spans() if s.name == "actorserve.request"]
            if len(found) >= n:
                return found
            await anyio.sleep(0.01)


def _children(exporter: InMemorySpanExporter, parent: ReadableSpan, name: str) -> list[Any]:
    return sorted(
        (
            s
            for s in exporter.get_finished_spans()
            if s.name == name
            and s.parent is not None
            and s.parent.span_id == parent.context.span_id
        ),
        key=lambda s: s.start_time or 0,
    )


def _attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def _events(span: ReadableSpan) -> list[str]:
    return [event.name for event in span.events]


async def test_a_request_is_one_span_under_the_clients_traceparent(
    spans: InMemorySpanExporter,
) -> None:
    async with (
        serving_tree(mode="aggregated", decode_workers=1) as tree,
        httpx.AsyncClient(base_url=tree.url) as client,
    ):
        headers = {"traceparent": TRACEPARENT, "x-request-id": "trace-me"}
        client.headers.update(headers)
        result = await _stream_text(client, "hello tracing", 8)
        assert result["error"] is None
        (request,) = await _requests(spans, 1)
    assert request.context.trace_id == int(TRACE_ID, 16)
    assert request.parent is not None and request.parent.span_id == int(CLIENT_SPAN, 16)
    attributes = _attrs(request)
    assert attributes["actorserve.request_id"] == "trace-me"
    assert attributes["gen_ai.request.model"] == "mock"
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert attributes["gen_ai.usage.output_tokens"] == 8
    assert attributes["gen_ai.usage.input_tokens"] == result["usage"]["prompt_tokens"]
    assert attributes["actorserve.attempts"] == 1
    assert "error.type" not in attributes and request.status.is_ok
    assert _events(request) == ["first_token"]
    (attempt,) = _children(spans, request, "actorserve.attempt")
    assert _attrs(attempt)["actorserve.worker_id"] == "decode-0"
    assert _attrs(attempt)["actorserve.role"] == "aggregated"
    assert attempt.status.is_ok


async def test_a_cancelled_request_ends_its_span_as_cancelled_not_failed(
    spans: InMemorySpanExporter,
) -> None:
    async with serving_tree(mode="aggregated", decode_workers=1) as tree:
        body = json.dumps(
            {"model": "mock", "prompt": "cancel me", "max_tokens": 500, "stream": True}
        )
        # A raw socket, closed after the first chunk: the client goes away mid-stream.
        async with await anyio.connect_tcp("127.0.0.1", tree.serving.port or 0) as sock:
            await sock.send(
                (
                    "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    "Content-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n{body}"
                ).encode()
            )
            received = b""
            while b"data: " not in received:
                received += await sock.receive()
        (request,) = await _requests(spans, 1)
    attributes = _attrs(request)
    assert attributes["actorserve.cancelled"] is True
    assert "error.type" not in attributes and request.status.is_ok
    assert "gen_ai.response.finish_reasons" not in attributes


async def test_a_migrated_request_has_two_attempts_and_a_migration_event(
    spans: InMemorySpanExporter,
) -> None:
    async with (
        serving_tree(
            mode="aggregated",
            decode_workers=2,
            router="round_robin",
            engine_args={"timing": {"speedup": 1.0}},
        ) as tree,
        httpx.AsyncClient(base_url=tree.url) as client,
    ):
        results: list[dict[str, Any]] = []

        async def run(i: int) -> None:
            results.append(await _stream_text(client, f"migrate {i}: tell me more", 120))

        victim = await tree.engine_stats("decode-0")
        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(run, i)
            with anyio.fail_after(30):
                while (await tree.engine_stats("decode-0")).running < 1:
                    await anyio.sleep(0.01)
            os.kill(victim.pid, signal.SIGKILL)
        assert all(r["error"] is None for r in results), results
        requests = await _requests(spans, 4)
    migrated = [r for r in requests if _attrs(r)["actorserve.attempts"] == 2]
    assert migrated, [_attrs(r) for r in requests]
    for request in migrated:
        assert request.status.is_ok
        assert _attrs(request)["gen_ai.usage.output_tokens"] == 120
        (migration,) = [e for e in request.events if e.name == "migration"]
        assert migration.attributes is not None
        assert migration.attributes["reason"] == "backend.engine_failure"
        assert migration.attributes["worker_id"] == "decode-0"
        first, second = _children(spans, request, "actorserve.attempt")
        assert _attrs(first)["actorserve.worker_id"] == "decode-0"
        assert _attrs(first)["error.type"] == "backend.engine_failure"
        assert not first.status.is_ok
        assert _attrs(second)["actorserve.worker_id"] == "decode-1"
        assert second.status.is_ok


async def test_a_disaggregated_request_shows_its_prefill_and_kv_transfer(
    spans: InMemorySpanExporter,
) -> None:
    async with (
        serving_tree(mode="disaggregated", prefill_workers=1, decode_workers=1) as tree,
        httpx.AsyncClient(base_url=tree.url) as client,
    ):
        result = await _stream_text(client, "disaggregated tracing: " + "context " * 8, 12)
        assert result["error"] is None
        (request,) = await _requests(spans, 1)
        (attempt,) = _children(spans, request, "actorserve.attempt")
        with anyio.fail_after(30):  # the prefill's span ends with its stream, drained apart
            while not _children(spans, attempt, "actorserve.prefill"):
                await anyio.sleep(0.01)
    assert _attrs(attempt)["actorserve.role"] == "decode"
    assert _attrs(attempt)["actorserve.worker_id"] == "decode-0"
    (prefill,) = _children(spans, attempt, "actorserve.prefill")
    assert _attrs(prefill)["actorserve.role"] == "prefill"
    assert _attrs(prefill)["actorserve.worker_id"] == "prefill-0"
    assert prefill.status.is_ok
    (transfer,) = _children(spans, attempt, "actorserve.kv_transfer")
    assert transfer.status.is_ok
    assert _events(request) == ["first_token"]


class _Collector(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP collector on a free loopback port: keeps what it is sent (path, body)."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Traces)
        self.received: list[tuple[str, bytes]] = []


class _Traces(http.server.BaseHTTPRequestHandler):
    server: _Collector

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        self.server.received.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_a_root_with_an_otlp_endpoint_sends_its_spans_there() -> None:
    collector = _Collector()
    thread = threading.Thread(target=collector.serve_forever)
    thread.start()
    port = free_port()
    endpoint = f"http://127.0.0.1:{collector.server_port}"
    root = start_root(
        port,
        *("--decode-workers", "1", "--grace-period", "0"),
        *("--otlp-endpoint", endpoint, "--trace-sample-ratio", "0"),
    )
    try:
        _wait_healthy(root, port)
        body = {"model": "mock", "prompt": "traced by a collector", "max_tokens": 4}
        for traceparent in (TRACEPARENT, None):  # the second: a new trace, not sampled (0)
            headers = {"x-request-id": "collected"}
            if traceparent is not None:
                headers["traceparent"] = traceparent
            url = f"http://127.0.0.1:{port}/v1/completions"
            assert httpx.post(url, json=body, headers=headers, timeout=60).status_code == 200
        root.send_signal(signal.SIGTERM)  # its spans still buffered go out as it stops
        out, _ = root.communicate(timeout=60)
    finally:
        if root.poll() is None:
            root.kill()
            root.communicate()
        collector.shutdown()
        thread.join()
        collector.server_close()
    assert root.returncode == 0, out
    received = collector.received
    assert received and {path for path, _ in received} == {"/v1/traces"}
    spans = [
        span
        for _, data in received
        for resource in ExportTraceServiceRequest.FromString(data).resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
    ]
    names = sorted(span.name for span in spans)
    assert names == ["actorserve.attempt", "actorserve.request"]  # the sampled trace only
    (request,) = [span for span in spans if span.name == "actorserve.request"]
    assert request.trace_id.hex() == TRACE_ID and request.parent_span_id.hex() == CLIENT_SPAN
    attributes = {a.key: a.value.string_value for a in request.attributes}
    assert attributes["actorserve.request_id"] == "collected"


def test_the_engine_request_carries_its_traceparent_across_processes() -> None:
    request = PreprocessedRequest(rid="r", token_ids=[1, 2], traceparent=TRACEPARENT)
    assert codec.decode(codec.encode(request)) == request
    assert b"traceparent" not in codec.encode(PreprocessedRequest(rid="r", token_ids=[1]))


# Serves one request with a traceparent through a real tree with tracing off; prints whether
# any of OpenTelemetry's SDK was imported and whether tracing came on.
_UNTRACED = textwrap.dedent(
    """
    import json, sys
    import anyio, httpx
    from actors import tracing
    from tests.helpers.serving import serving_tree

    async def main() -> None:
        async with serving_tree(mode="aggregated", decode_workers=1) as tree:
            async with httpx.AsyncClient(base_url=tree.url) as client:
                response = await client.post(
                    "/v1/completions",
                    json={"model": "mock", "prompt": "untraced", "max_tokens": 4},
                    headers={"traceparent": sys.argv[1]},
                )
        sdk = [m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.ex"))]
        on = tracing.tracer() is not None
        print(json.dumps({"status": response.status_code, "sdk": sdk, "on": on}))

    anyio.run(main)
    """
)


def test_with_tracing_off_nothing_of_the_sdk_is_imported() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _UNTRACED, TRACEPARENT],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"status": 200, "sdk": [], "on": False}


@pytest.mark.parametrize("ratio", [-0.5, 1.01])
def test_a_bad_sample_ratio_is_a_clear_error(ratio: float) -> None:
    with pytest.raises(ValueError, match=r"trace sample ratio .*: expected a number from 0 to 1"):
        load_config(None, {"backend": "mock", "trace_sample_ratio": ratio})
    result = CliRunner().invoke(app, ["run", "--backend", "mock", f"--trace-sample-ratio={ratio}"])
    assert result.exit_code == 2
    assert "--trace-sample-ratio" in result.output


def test_the_options_reach_the_config() -> None:
    config = load_config(
        None,
        {"backend": "mock", "otlp_endpoint": "http://collector:4318", "trace_sample_ratio": 0.25},
    )
    assert (config.otlp_endpoint, config.trace_sample_ratio) == ("http://collector:4318", 0.25)
    assert load_config(None, {"backend": "mock"}).otlp_endpoint is None
