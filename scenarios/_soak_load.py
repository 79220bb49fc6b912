"""The soak's mixed load: closed-loop clients sending chat and completion requests, streamed or
not, of varied lengths, some abandoned by their client and some malformed on purpose.

Every request ends in exactly one outcome, and only the counts are kept (a soak sends tens of
thousands of requests, and whatever it kept would grow the very process it measures):

- ``ok``: a complete answer (a stream: a ``finish_reason``, then ``data: [DONE]``);
- ``error``: a typed error, as a status with an OpenAI error body or as a stream's
  ``event: error`` frame followed by ``[DONE]``;
- ``refused``: 503 (or 429) with ``Retry-After``, before any output;
- ``invalid``: a malformed request answered with a 4xx and an OpenAI error body;
- ``cancelled``: the client hung up on purpose;
- ``lost``: anything else: a transport error, a stream cut before ``[DONE]``, an internal error
  (500 ``internal``), a body that is not OpenAI's error format, a 503 without ``Retry-After``, a
  valid request refused as invalid or a malformed one served.
"""

from __future__ import annotations

import json
import random
from collections import Counter, deque
from typing import Any

import anyio
import attrs
import httpx

from scenarios._workload import Clock, RequestRecord

__all__ = ["OUTCOMES", "Tally", "run_load"]

OUTCOMES = ("ok", "error", "refused", "invalid", "cancelled", "lost")
_CHAT, _COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# What a client picks, and how often: mostly real traffic, a few hang-ups and malformed requests.
_KINDS = {
    "chat-stream": 30,
    "chat": 15,
    "completion-stream": 25,
    "completion": 15,
    "cancel": 7,
    "bad": 8,
}
_PROMPT_CHARS = (8, 40, 200, 800, 2000)
_MAX_TOKENS = (1, 8, 32, 96, 256)
_WORDS = ("actors", "supervise", "engines", "that", "stream", "tokens", "while", "trees", "heal")


@attrs.define
class Tally:
    """Requests by kind and outcome, error codes, and a few examples of lost ones."""

    by_kind: dict[str, Counter[str]] = attrs.field(factory=dict)
    error_codes: Counter[str] = attrs.field(factory=Counter)
    lost: deque[str] = attrs.field(factory=lambda: deque(maxlen=20))

    def add(self, kind: str, outcome: str, detail: str = "") -> None:
        self.by_kind.setdefault(kind, Counter())[outcome] += 1
        if outcome in ("error", "refused", "invalid") and detail:
            self.error_codes[detail] += 1
        if outcome == "lost":
            self.lost.append(f"{kind}: {detail}")

    def add_record(self, record: RequestRecord) -> None:
        """A request a fault sent itself (a burst), as :mod:`scenarios._workload` recorded it."""
        if record.ok:
            self.add(record.group, "ok")
        elif record.status == 503 and record.retry_after and record.retry_after[-1] is not None:
            self.add(record.group, "refused", (record.error or "").partition(":")[0])
        elif record.error is None or record.error.startswith("transport"):
            self.add(record.group, "lost", record.error or "ended without a finish_reason")
        else:
            self.add(record.group, "error", record.error.partition(":")[0])

    @property
    def by_outcome(self) -> dict[str, int]:
        total: Counter[str] = Counter()
        for counts in self.by_kind.values():
            total.update(counts)
        return {outcome: total[outcome] for outcome in OUTCOMES}

    @property
    def total(self) -> int:
        return sum(self.by_outcome.values())


def _prompt(rng: random.Random) -> str:
    chars = rng.choice(_PROMPT_CHARS)
    text = " ".join(rng.choice(_WORDS) for _ in range(chars // 5 + 1))
    return text[:chars]


def _valid_body(kind: str, model: str, rng: random.Random) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": rng.choice(_MAX_TOKENS),
        "temperature": rng.choice((0.0, 0.7)),
        "stream": kind.endswith("stream") or kind == "cancel",
    }
    if kind.startswith("chat"):
        body["messages"] = [{"role": "user", "content": _prompt(rng)}]
        return _CHAT, body
    body["prompt"] = _prompt(rng)
    return _COMPLETIONS, body


def _bad_request(model: str, rng: random.Random) -> tuple[str, str, bytes]:
    """A malformed request: (method, path, body)."""
    ok: dict[str, Any] = {"model": model, "prompt": "hello", "max_tokens": 4}
    bad: list[tuple[str, str, Any]] = [
        ("POST", _COMPLETIONS, b'{"model": "' + model.encode() + b'", "prompt": '),
        ("POST", _COMPLETIONS, {**ok, "model": "no-such-model"}),
        ("POST", _COMPLETIONS, {**ok, "model": "no-such-model", "stream": True}),
        ("POST", _COMPLETIONS, {**ok, "max_tokens": -1}),
        ("POST", _COMPLETIONS, {**ok, "temperature": "hot"}),
        ("POST", _COMPLETIONS, {**ok, "prompt": "x" * 20_000}),  # beyond the context
        ("POST", _CHAT, {"model": model, "max_tokens": 4}),  # no messages
        ("POST", _CHAT, {"model": model, "messages": [{"role": "wizard", "content": "hi"}]}),
        ("GET", _COMPLETIONS, b""),
    ]
    method, path, body = rng.choice(bad)
    return method, path, body if isinstance(body, bytes) else json.dumps(body).encode()


def _refusal(response: httpx.Response, raw: bytes, *, valid: bool) -> tuple[str, str]:
    """The outcome of a non-200 answer (its body read: ``raw``)."""
    status = response.status_code
    try:
        error = json.loads(raw)["error"]
        code, message = str(error.get("code")), str(error["message"])
    except (ValueError, KeyError, TypeError):
        return "lost", f"HTTP {status} without an OpenAI error body"
    if code == "internal":
        return "lost", f"HTTP {status}: internal error: {message}"
    if status in (429, 503):
        if response.headers.get("retry-after") is None:
            return "lost", f"HTTP {status} {code} without Retry-After"
        return "refused", code
    if 400 <= status < 500:
        if valid:
            return "lost", f"a valid request refused: HTTP {status} {code}: {message}"
        return "invalid", code
    return "error", code


def _answer(raw: bytes) -> tuple[str, str]:
    try:
        finish = json.loads(raw)["choices"][0]["finish_reason"]
    except (ValueError, KeyError, IndexError, TypeError):
        return "lost", "a 200 answer without choices"
    return ("ok", "") if finish else ("lost", "a 200 answer without a finish_reason")


async def _read_stream(response: httpx.Response) -> tuple[str, str]:
    """Read an event stream to its end; its outcome."""
    finish: str | None = None
    error: str | None = None
    done = False
    event = ""
    async for line in response.aiter_lines():
        if not line:
            event = ""  # a blank line ends an SSE frame
        elif line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            if done:
                return "lost", "data after [DONE]"
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            if event == "error" or "error" in chunk:
                error = str(chunk.get("error", {}).get("code"))
                continue
            for choice in chunk.get("choices", []):
                finish = choice.get("finish_reason") or finish
    if not done:
        return "lost", "cut: the stream ended without [DONE]"
    if error is not None:
        return ("lost", "internal error event") if error == "internal" else ("error", error)
    return ("ok", "") if finish else ("lost", "[DONE] without a finish_reason")


async def _send(
    client: httpx.AsyncClient,
    method: str,
    path: str,
    content: bytes,
    *,
    valid: bool,
    timeout: float,
) -> tuple[str, str]:
    headers = {"content-type": "application/json"}
    request = client.build_request(method, path, content=content, headers=headers, timeout=timeout)
    response = await client.send(request, stream=True)
    try:
        if response.status_code != 200:
            return _refusal(response, await response.aread(), valid=valid)
        if not valid:
            return "lost", "a malformed request was served"
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            return await _read_stream(response)
        return _answer(await response.aread())
    finally:
        await response.aclose()


async def _one(
    client: httpx.AsyncClient, kind: str, model: str, rng: random.Random, timeout: float
) -> tuple[str, str]:
    """Send one request of ``kind``; its outcome and a detail (an error code, what was lost)."""
    try:
        if kind == "bad":
            method, path, content = _bad_request(model, rng)
            return await _send(client, method, path, content, valid=False, timeout=timeout)
        path, body = _valid_body(kind, model, rng)
        if kind != "cancel":
            return await _send(
                client, "POST", path, json.dumps(body).encode(), valid=True, timeout=timeout
            )
        # The client hangs up at a random moment: queued, in prefill or mid-stream.
        with anyio.move_on_after(rng.uniform(0.01, 0.5)):
            return await _send(
                client, "POST", path, json.dumps(body).encode(), valid=True, timeout=timeout
            )
        return "cancelled", ""
    except (httpx.HTTPError, OSError) as exc:
        return "lost", f"transport: {type(exc).__name__}: {exc}"
    except json.JSONDecodeError as exc:
        return "lost", f"a frame that is not JSON: {exc}"


async def run_load(
    client: httpx.AsyncClient,
    model: str,
    tally: Tally,
    clock: Clock,
    *,
    until: float,
    clients: int,
    seed: int = 0,
    timeout: float = 90.0,
) -> None:
    """``clients`` closed-loop clients, each sending one request after another (with a short
    random pause) until ``until`` seconds on ``clock``."""
    kinds, weights = list(_KINDS), list(_KINDS.values())

    async def one_client(n: int) -> None:
        rng = random.Random(seed * 1000 + n)
        while clock.now() < until:
            kind = rng.choices(kinds, weights)[0]
            outcome, detail = await _one(client, kind, model, rng, timeout)
            tally.add(kind, outcome, detail)
            # A refused client backs off for about the second Retry-After asks, as OpenAI's does.
            pause = rng.uniform(0.5, 1.0) if outcome == "refused" else rng.uniform(0.0, 0.1)
            await anyio.sleep(pause)

    async with anyio.create_task_group() as tg:
        for n in range(clients):
            tg.start_soon(one_client, n)
