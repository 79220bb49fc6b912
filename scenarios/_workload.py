"""The client side: requests over real HTTP, each recorded with its timing and outcome."""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

import anyio
import attrs
import httpx

from scenarios._model import Workload

__all__ = ["Clock", "RequestRecord", "run_workload", "send"]


class Clock:
    """Seconds since the run's start (all times in a report are relative to it)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0


@attrs.define(kw_only=True)
class RequestRecord:
    """One request as its client saw it."""

    id: str
    group: str = "workload"  # workload, burst, cancel
    started: float = 0.0
    first_token: float | None = None
    ended: float | None = None
    chunk_times: list[float] = attrs.field(factory=list)
    text: str = ""
    finish: str | None = None
    completion_tokens: int | None = None
    status: int | None = None
    error: str | None = None  # the error code (and message) the client got
    rejections: int = 0  # 503s before it was admitted (or gave up)
    retry_after: list[str | None] = attrs.field(factory=list)  # Retry-After of each 503
    cancelled: bool = False  # the client disconnected on purpose
    cancel_phase: str | None = None  # what the client had seen when it disconnected

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cancelled and self.finish is not None

    @property
    def latency(self) -> float | None:
        return None if self.ended is None else self.ended - self.started

    @property
    def max_gap(self) -> float:
        """The longest wait between two streamed chunks."""
        times = self.chunk_times
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def _body(workload: Workload, prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": workload.temperature,
        "seed": workload.seed,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def send(
    client: httpx.AsyncClient,
    record: RequestRecord,
    body: dict[str, Any],
    clock: Clock,
    *,
    retries: int = 0,
    retry_after_cap_s: float = 0.2,
    timeout_s: float = 60.0,
) -> None:
    """Send one completion request and fill ``record``; never raises for a failed request."""
    record.started = clock.now()
    attempt = 0
    while True:
        try:
            status = await _attempt(client, record, body, clock, timeout_s)
        except (httpx.HTTPError, OSError, json.JSONDecodeError) as exc:
            # A stream broken after its first token is the worst outcome: say so.
            cut = "cut mid-stream: " if record.first_token is not None else ""
            record.error = f"transport: {cut}{type(exc).__name__}: {exc}"
            status = None
        if status == 503 and attempt < retries:
            attempt += 1
            wait = _seconds(record.retry_after[-1]) if record.retry_after else None
            await anyio.sleep(min(retry_after_cap_s, wait if wait is not None else 0.05))
            record.error = None
            continue
        break
    record.ended = clock.now()


def _seconds(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


async def _attempt(
    client: httpx.AsyncClient,
    record: RequestRecord,
    body: dict[str, Any],
    clock: Clock,
    timeout_s: float,
) -> int:
    async with client.stream("POST", "/v1/completions", json=body, timeout=timeout_s) as response:
        record.status = response.status_code
        if response.status_code != 200:
            if response.status_code == 503:
                record.rejections += 1
                record.retry_after.append(response.headers.get("retry-after"))
            record.error = _error_text(await response.aread(), response.status_code)
            return response.status_code
        if not body["stream"]:
            _take_completion(record, json.loads(await response.aread()), clock)
            return 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
                record.error = f"{error.get('code')}: {error.get('message')}"
                continue
            _take_chunk(record, event, clock)
    return 200


def _take_chunk(record: RequestRecord, event: dict[str, Any], clock: Clock) -> None:
    got_text = False
    for choice in event.get("choices", []):
        text = choice.get("text") or ""
        if text:
            record.text += text
            got_text = True
        record.finish = choice.get("finish_reason") or record.finish
    if got_text:
        now = clock.now()
        if record.first_token is None:
            record.first_token = now
        record.chunk_times.append(now)
    usage = event.get("usage")
    if usage:
        record.completion_tokens = usage.get("completion_tokens")


def _take_completion(record: RequestRecord, data: dict[str, Any], clock: Clock) -> None:
    choice = data["choices"][0]
    record.text = choice.get("text") or ""
    record.finish = choice.get("finish_reason")
    record.first_token = clock.now()
    record.completion_tokens = (data.get("usage") or {}).get("completion_tokens")


def _error_text(raw: bytes, status: int) -> str:
    try:
        error = json.loads(raw)["error"]
        return f"{error.get('code')}: {error.get('message')}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}"


async def run_workload(
    client: httpx.AsyncClient, workload: Workload, model: str, clock: Clock
) -> list[RequestRecord]:
    """Every client's requests, in order per client; returns the records (client-major)."""
    records = [
        [RequestRecord(id=f"c{c}r{r}") for r in range(workload.requests_per_client)]
        for c in range(workload.clients)
    ]

    async def one_client(c: int) -> None:
        for r, record in enumerate(records[c]):
            if r and workload.think_s:
                await anyio.sleep(workload.think_s)
            body = _body(workload, workload.prompt(c, r), workload.max_tokens, workload.stream)
            body["model"] = model
            await send(
                client,
                record,
                body,
                clock,
                retries=workload.retries,
                retry_after_cap_s=workload.retry_after_cap_s,
                timeout_s=workload.timeout_s,
            )

    async with anyio.create_task_group() as tg:
        for c in range(workload.clients):
            tg.start_soon(one_client, c)
    return [record for per_client in records for record in per_client]


def request_body(
    workload: Workload, model: str, prompt: str, max_tokens: int, *, stream: bool = True
) -> dict[str, Any]:
    """A request like the workload's, for the requests faults send themselves."""
    body = _body(workload, prompt, max_tokens, stream)
    body["model"] = model
    return body


async def send_and_hang_up(
    host: str,
    port: int,
    body: dict[str, Any],
    record: RequestRecord,
    clock: Clock,
    *,
    after_first_token: bool,
    after_s: float,
) -> None:
    """A streamed request whose client disconnects: after its first token, or ``after_s``.

    A raw socket, not httpx: the disconnect is then exactly a closed connection, and no HTTP
    client machinery is left half-read behind it.
    """
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    record.started = clock.now()
    async with await anyio.connect_tcp(host, port) as sock:
        await sock.send(head + payload)
        buffer = b""
        with anyio.move_on_after(None if after_first_token else after_s):
            while record.finish is None and (record.first_token is None or not after_first_token):
                try:
                    data = await sock.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    record.error = "the server closed the connection first"
                    break
                buffer += data
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    _take_raw_line(record, line, clock)
        record.cancelled = record.error is None and record.finish is None
    record.ended = clock.now()


def _take_raw_line(record: RequestRecord, line: bytes, clock: Clock) -> None:
    if line.startswith(b"HTTP/1.1 "):
        record.status = int(line.split()[1])
    if not line.startswith(b"data: {"):
        return  # headers, chunk sizes, keep-alives
    try:
        event = json.loads(line[6:])
    except ValueError:
        return
    if "error" in event:
        record.error = f"{event['error'].get('code')}: {event['error'].get('message')}"
    else:
        _take_chunk(record, event, clock)
