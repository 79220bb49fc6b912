"""``actorserve scenario fuzz-http``: schemathesis against a served root's own OpenAPI schema.

A root (``actorserve run`` with mock engines: a chat model disaggregated over one prefill and two
decode workers, an embedding and an image model beside it) runs in a process of its own on
127.0.0.1. The fuzzer loads the schema that root serves and sends requests generated from it, one
at a time over real connections: schema-valid ones mostly, some invalid ones, every body naming
the served model of its path's kind so that most reach the engines. It counts the
answers; a server error is a 5xx, a stream that reports an error or never ends with ``[DONE]``, or
no answer at all (a connection error, a timeout).
"""

from __future__ import annotations

import contextlib
import functools
import random
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import attrs
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from rich.console import Console
from rich.table import Table
from schemathesis import GenerationMode
from schemathesis.core.result import Err

from actors.serving import ModelConfig, ServeConfig
from scenarios._model import FAST_ENGINE, topology
from scenarios._subprocess import open_root_process

__all__ = ["FuzzReport", "fuzz_http"]

_START_TIMEOUT_S = 60.0
#: A request unanswered this long counts as a hang.
_REQUEST_TIMEOUT_S = 30.0
#: The server errors described in the report (all of them are counted).
_KEPT_FAILURES = 20
#: A generation endpoint gets this many times the cases of another operation (most of the surface
#: is in their bodies); of an operation's cases, this share is schema-valid.
_BODY_WEIGHT = 8
_POSITIVE_SHARE = 0.8


def _root_config() -> ServeConfig:
    """The served root: mock engines with no simulated time (``instant``) and a small EOS rate,
    so that most generations are short and every case quick: the chat model disaggregated (1
    prefill, 2 decode), an embedding and an image model beside it (one worker each)."""
    instant = {**FAST_ENGINE, "timing": {"instant": True}}
    beside = [
        ModelConfig(kind=kind, backend="mock", decode_workers=1, engine_args=instant)
        for kind in ("embedding", "image")
    ]
    return topology(
        mode="disaggregated",
        prefill_workers=1,
        decode_workers=2,
        engine_args={"timing": {"instant": True}, "eos_rate": 0.02},
        models=beside,
    )


def _model_by_path(config: ServeConfig) -> dict[str, str]:
    """The model each generation path's bodies name: one of the kind it takes."""
    names = {m.kind: m.model for m in config.served()}
    return {
        "/v1/chat/completions": names["chat"],
        "/v1/completions": names["chat"],
        "/v1/embeddings": names["embedding"],
        "/v1/images/generations": names["image"],
    }


@attrs.define
class FuzzReport:
    """What the pass sent and what came back: per operation, status counts."""

    seed: int = 0
    cases: int = 0
    server_errors: int = 0
    status_counts: Counter[str] = attrs.field(factory=Counter)
    operations: dict[str, Counter[str]] = attrs.field(factory=dict)
    failures: list[str] = attrs.field(factory=list)
    #: Schema-valid requests refused (4xx), by the field and code the error names: what the schema
    #: allows and the server does not (semantic limits, such as the context length, among them).
    refusals: Counter[str] = attrs.field(factory=Counter)
    duration_s: float = 0.0
    root_log: list[str] = attrs.field(factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "cases": self.cases,
            "server_errors": self.server_errors,
            "status_counts": dict(sorted(self.status_counts.items())),
            "valid_refused": dict(self.refusals.most_common()),
            "duration_s": round(self.duration_s, 1),
            "seed": self.seed,
        }

    def render(self, console: Console) -> None:
        statuses = sorted(self.status_counts)
        table = Table("operation", "cases", *statuses, title="fuzz-http")
        for label, counts in self.operations.items():
            table.add_row(label, str(counts.total()), *(str(counts[s]) for s in statuses))
        table.add_row("total", str(self.cases), *(str(self.status_counts[s]) for s in statuses))
        console.print(table)
        if self.refusals:
            refused = Table("field: code", "cases", title="schema-valid requests refused")
            for reason, count in self.refusals.most_common():
                refused.add_row(reason, str(count))
            console.print(refused)
        for failure in self.failures:
            console.print(f"[red]server error:[/red] {failure}", markup=False, highlight=False)
        if self.server_errors:
            console.print("the root's last log lines:")
            console.print("\n".join(self.root_log), markup=False, highlight=False)


def fuzz_http(cases: int, *, loop: str = "asyncio", seed: int | None = None) -> FuzzReport:
    """Start a root on ``loop`` and send it about ``cases`` generated requests (fewer only if an
    operation's inputs run out). The report has the seed (random unless given), which makes the
    same requests again."""
    seed = random.getrandbits(32) if seed is None else seed
    run = functools.partial(_fuzz_root, _root_config(), cases, loop, seed)
    report: FuzzReport = anyio.run(run, backend=loop)
    return report


async def _fuzz_root(config: ServeConfig, cases: int, loop: str, seed: int) -> FuzzReport:
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="actorserve-fuzz-") as tmp:
        config = attrs.evolve(config, image_dir=str(Path(tmp) / "images"))
        async with open_root_process(config, Path(tmp), loop, _START_TIMEOUT_S) as root:
            fuzzer = _Fuzzer(root.url, _model_by_path(config), seed)
            # The fuzzer blocks (requests, hypothesis): it runs in a thread while this loop reads
            # the root's log.
            try:
                report = await anyio.to_thread.run_sync(fuzzer.run, cases, abandon_on_cancel=True)
            finally:
                fuzzer.stopping.set()  # cancelled (Ctrl-C): the thread ends at its next case
            report.root_log = list(root.log)
    report.duration_s = time.monotonic() - began
    return report


class _Stopped(BaseException):
    """The pass was cancelled; a BaseException, which hypothesis lets through at once."""


class _Fuzzer:
    def __init__(self, url: str, models: dict[str, str], seed: int) -> None:
        self.url = url
        self.models = models
        self.seed = seed
        self.report = FuzzReport(seed=seed)
        self.session = requests.Session()
        self.stopping = threading.Event()

    def run(self, cases: int) -> FuzzReport:
        schema = schemathesis.openapi.from_url(f"{self.url}/openapi.json")
        operations = []
        for result in schema.get_all_operations():
            if isinstance(result, Err):
                raise result.err()  # the served schema is broken: nothing to fuzz
            operations.append(result.ok())
        # Smallest first: an operation whose inputs run out leaves its cases to the later ones.
        operations.sort(key=_weight)
        weights = sum(_weight(op) for op in operations)
        with self.session, contextlib.suppress(_Stopped):
            for operation in operations:
                budget = round((cases - self.report.cases) * _weight(operation) / weights)
                weights -= _weight(operation)
                # Invalid inputs exist only for a body: any path segment is a valid model name.
                positive = round(budget * _POSITIVE_SHARE) if operation.body else budget
                self._generate(operation, GenerationMode.POSITIVE, positive)
                self._generate(operation, GenerationMode.NEGATIVE, budget - positive)
        return self.report

    def _generate(
        self,
        operation: schemathesis.APIOperation[Any, Any, Any, Any],
        mode: GenerationMode,
        budget: int,
    ) -> None:
        if budget <= 0:
            return
        counts = self.report.operations.setdefault(operation.label, Counter())

        @settings(
            max_examples=budget,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(generation_mode=mode))
        def send(case: schemathesis.Case[Any]) -> None:
            status = self._send(case, mode)
            counts[status] += 1
            self.report.status_counts[status] += 1
            self.report.cases += 1

        hypothesis_seed(self.seed)(send)()

    def _send(self, case: schemathesis.Case[Any], mode: GenerationMode) -> str:
        """Send ``case``; its status (``no_response`` if none came), a server error counted."""
        if self.stopping.is_set():
            raise _Stopped
        model = self.models.get(case.operation.path)
        body = case.body
        if model is not None and isinstance(body, dict) and isinstance(body.get("model"), str):
            body["model"] = model
        kwargs = case.as_transport_kwargs(base_url=self.url)
        try:
            response = self.session.request(**kwargs, timeout=_REQUEST_TIMEOUT_S)
        except requests.RequestException as exc:
            self._server_error(case, mode, f"no response: {type(exc).__name__}: {exc}")
            return "no_response"
        status = response.status_code
        if 400 <= status < 500 and mode is GenerationMode.POSITIVE:
            self.report.refusals[_refusal(response)] += 1
        if status >= 500:
            self._server_error(case, mode, f"{status}: {response.text[:300]}")
        elif status == 200 and response.headers.get("content-type", "").startswith(
            "text/event-stream"
        ):
            problem = _stream_problem(response.text)
            if problem is not None:
                self._server_error(case, mode, f"200 stream: {problem}")
        return str(status)

    def _server_error(self, case: schemathesis.Case[Any], mode: GenerationMode, what: str) -> None:
        self.report.server_errors += 1
        if len(self.report.failures) < _KEPT_FAILURES:
            curl = case.as_curl_command(base_url=self.url)
            self.report.failures.append(f"{case.operation.label} ({mode.value}) {what}\n  {curl}")


def _weight(operation: schemathesis.APIOperation[Any, Any, Any, Any]) -> int:
    return _BODY_WEIGHT if operation.body else 1


def _refusal(response: requests.Response) -> str:
    """``field: code`` of an OpenAI error answer (its status if it has no such body)."""
    try:
        error = response.json()["error"]
        return f"{error['param'] or '-'}: {error['code'] or '-'}"
    except (ValueError, KeyError, TypeError):
        return f"-: {response.status_code}"


def _stream_problem(body: str) -> str | None:
    """What is wrong with a 200 event stream: an error event, or no ``[DONE]`` at its end."""
    events = [event for event in body.split("\n\n") if event.strip()]
    errors = [event for event in events if event.startswith("event: error")]
    if errors:
        return errors[0][:300]
    if not events or events[-1].strip() != "data: [DONE]":
        return f"no [DONE] at the end ({len(events)} events)"
    return None
