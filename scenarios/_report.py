"""A scenario's report: checks, counters, faults and every request; JSON and a terminal table."""

from __future__ import annotations

import io
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console
from rich.table import Table

from scenarios._inject import FaultRecord
from scenarios._workload import RequestRecord

__all__ = ["CheckResult", "Report", "RequestSummary", "ScenarioFailed"]


class ScenarioFailed(AssertionError):
    """A scenario's expectations did not hold; the message is the report's summary."""

    def __init__(self, report: Report) -> None:
        super().__init__("\n" + report.summary())
        self.report = report


@attrs.frozen
class CheckResult:
    name: str
    passed: bool
    expected: str
    observed: str


@attrs.frozen(kw_only=True)
class RequestSummary:
    """The outcome of one run of the workload."""

    requests: int
    succeeded: int
    failed: int
    rejections: int  # 503s clients met (then retried)
    success_rate: float
    tokens: int
    latency_p50_s: float | None
    latency_max_s: float | None
    ttft_p50_s: float | None
    max_token_gap_s: float
    duration_s: float

    @classmethod
    def of(cls, records: Sequence[RequestRecord], duration_s: float) -> RequestSummary:
        ok = [r for r in records if r.ok]
        latencies = [r.latency for r in ok if r.latency is not None]
        ttfts = [r.first_token - r.started for r in ok if r.first_token is not None]
        return cls(
            requests=len(records),
            succeeded=len(ok),
            failed=len(records) - len(ok),
            rejections=sum(r.rejections for r in records),
            success_rate=len(ok) / len(records) if records else 1.0,
            tokens=sum(r.completion_tokens or 0 for r in ok),
            latency_p50_s=statistics.median(latencies) if latencies else None,
            latency_max_s=max(latencies) if latencies else None,
            ttft_p50_s=statistics.median(ttfts) if ttfts else None,
            max_token_gap_s=max((r.max_gap for r in records), default=0.0),
            duration_s=duration_s,
        )


@attrs.define(kw_only=True)
class Report:
    """Everything one scenario run established. ``passed`` is every check passing."""

    scenario: str
    description: str = ""
    backend: str = "asyncio"
    passed: bool = False
    checks: list[CheckResult] = attrs.field(factory=list)
    counters: dict[str, float] = attrs.field(factory=dict)
    faults: list[FaultRecord] = attrs.field(factory=list)
    workload: RequestSummary | None = None
    baseline: RequestSummary | None = None
    recovery_s: float | None = None
    durations: dict[str, float] = attrs.field(factory=dict)
    requests: list[RequestRecord] = attrs.field(factory=list)  # the faulted run's
    leaks: list[str] = attrs.field(factory=list)
    root_exit_code: int | None = None  # of a root run in its own process, once it exited
    error: str | None = None  # the run itself broke (the tree did not start, ...)

    def failed_checks(self) -> list[CheckResult]:
        return [c for c in self.checks if not c.passed]

    def assert_passed(self) -> None:
        """Raise :class:`ScenarioFailed` (an ``AssertionError``) with a readable summary
        unless every check passed."""
        if not self.passed:
            raise ScenarioFailed(self)

    # -- JSON ---------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        def dump(value: Any) -> Any:
            if attrs.has(type(value)):
                data = {a.name: dump(getattr(value, a.name)) for a in attrs.fields(type(value))}
                if isinstance(value, RequestRecord):
                    data["ok"] = value.ok
                if isinstance(value, FaultRecord):
                    data["injected"] = value.injected
                return data
            if isinstance(value, list | tuple):
                return [dump(v) for v in value]
            if isinstance(value, dict):
                return {k: dump(v) for k, v in value.items()}
            if isinstance(value, float):
                return round(value, 6)
            return value

        data: dict[str, Any] = dump(self)
        return data

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json(indent=1))

    # -- the terminal -------------------------------------------------------------------------

    def render(self, console: Console | None = None) -> None:
        """Print the summary: verdict, checks, faults, counters, the two runs."""
        console = console or Console()
        verdict = "[bold green]PASSED[/]" if self.passed else "[bold red]FAILED[/]"
        total = self.durations.get("total", 0.0)
        console.print(f"[bold]{self.scenario}[/] ({self.backend}): {verdict} in {total:.1f} s")
        if self.description:
            console.print(f"  {self.description}")
        if self.error:
            console.print(f"  [red]error:[/] {self.error}")
        checks = Table("", "check", "expected", "observed", title="checks", title_justify="left")
        for c in self.checks:
            mark = "[green]✓[/]" if c.passed else "[red]✗[/]"
            checks.add_row(mark, c.name, c.expected, c.observed)
        console.print(checks)
        if self.faults:
            faults = Table("fault", "target", "due", "injected", "what happened", title="faults")
            faults.title_justify = "left"
            for f in self.faults:
                when = f"{f.injected_at:.2f} s" if f.injected_at is not None else "-"
                what = f"[red]{f.error}[/]" if f.error else f.detail
                faults.add_row(f.description, f.target, f"{f.at:.2f} s", when, what)
            console.print(faults)
        runs = Table(
            "run", "requests", "ok", "503s", "p50 latency", "max latency", "max gap", "duration"
        )
        runs.title, runs.title_justify = "workload", "left"
        for name, s in (("baseline", self.baseline), ("faulted", self.workload)):
            if s is not None:
                runs.add_row(
                    name,
                    str(s.requests),
                    f"{s.succeeded} ({s.success_rate:.0%})",
                    str(s.rejections),
                    _secs(s.latency_p50_s),
                    _secs(s.latency_max_s),
                    _secs(s.max_token_gap_s),
                    _secs(s.duration_s),
                )
        console.print(runs)
        shown = {k: v for k, v in self.counters.items() if v}
        console.print(
            "counters: " + (", ".join(f"{k}={v:g}" for k, v in shown.items()) or "all zero")
        )

    def summary(self, width: int = 120) -> str:
        """The rendered summary as plain text."""
        console = Console(file=io.StringIO(), width=width, color_system=None, record=True)
        self.render(console)
        return console.export_text()


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"
