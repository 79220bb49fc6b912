"""A soak's configuration, and what it established: checks, requests by outcome, faults,
counters, each role's resource levels; as JSON, a terminal table and one summary line."""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console
from rich.table import Table

from scenarios._inject import FaultRecord
from scenarios._report import CheckResult
from scenarios._soak_load import OUTCOMES, Tally
from scenarios._soak_resources import METRICS, Level, Sampler, Tolerance, level

__all__ = ["SoakConfig", "SoakReport"]

_MIB = 1 << 20


@attrs.frozen(kw_only=True)
class SoakConfig:
    """How long, how often a fault, how often a sample, how many clients, how flat."""

    duration_s: float = 1800.0
    fault_every_s: float = 60.0
    sample_every_s: float = 5.0
    warmup_s: float | None = None  # default: a minute, or a quarter of a shorter run
    clients: int = 6
    seed: int = 0
    settle_s: float = 30.0  # after the load: how long workers get to be routable again
    tolerance: Tolerance = attrs.field(factory=Tolerance)

    def __attrs_post_init__(self) -> None:
        if self.duration_s <= 0 or self.fault_every_s <= 0 or self.sample_every_s <= 0:
            raise ValueError("duration, fault period and sample period must be > 0")

    @property
    def warmup(self) -> float:
        return self.warmup_s if self.warmup_s is not None else min(60.0, self.duration_s / 4)


@attrs.define(kw_only=True)
class SoakReport:
    """What a soak established. ``passed`` is every check passing."""

    config: SoakConfig
    backend: str = "asyncio"
    passed: bool = False
    checks: list[CheckResult] = attrs.field(factory=list)
    tally: Tally = attrs.field(factory=Tally)
    faults: list[FaultRecord] = attrs.field(factory=list)
    counters: dict[str, float] = attrs.field(factory=dict)
    sampler: Sampler | None = None
    leaks: list[str] = attrs.field(factory=list)
    load_s: float = 0.0
    error: str | None = None

    @property
    def samples(self) -> int:
        return self.sampler.count if self.sampler is not None else 0

    @property
    def faults_injected(self) -> int:
        return sum(f.injected for f in self.faults)

    def levels(self) -> dict[str, dict[str, Level]]:
        """Every sampled role's metrics."""
        if self.sampler is None:
            return {}
        warmup, tol = self.config.warmup, self.config.tolerance
        return {
            role: {metric: level(samples, metric, warmup, tol) for metric in METRICS}
            for role, samples in self.sampler.series.items()
            if samples or role != "forkserver"  # the forkserver may be another process's
        }

    def pids(self) -> dict[str, int]:
        """How many processes each role had (1 + its restarts that a sample saw)."""
        if self.sampler is None:
            return {}
        return {role: len({s.pid for s in ss}) for role, ss in self.sampler.series.items()}

    # -- the verdict --------------------------------------------------------------------------

    def judge(self, routable: str | None) -> None:
        outcomes, total = self.tally.by_outcome, self.tally.total
        self.checks = [
            CheckResult(
                "load ran",
                total > 0 and outcomes["ok"] > 0,
                "requests, some answered",
                f"{total} requests, {outcomes['ok']} ok",
            ),
            CheckResult(
                "nothing lost",
                total > 0 and outcomes["lost"] == 0,
                "every request answered, refused or cancelled properly",
                f"{outcomes['lost']} of {total} lost"
                + "".join(f"; {x}" for x in list(self.tally.lost)[:3]),
            ),
        ]
        missed = [f"{f.description}: {f.error}" for f in self.faults if not f.injected]
        self.checks.append(
            CheckResult(
                "faults injected",
                bool(self.faults) and not missed,
                "every due fault, at least one",
                f"{self.faults_injected}/{len(self.faults)}" + "".join(f"; {m}" for m in missed),
            )
        )
        if routable is not None:
            self.checks.append(
                CheckResult(
                    "workers routable after the load", not routable, "all", routable or "all"
                )
            )
        tol = self.config.tolerance
        expected = (
            f"late <= early + max({tol.fraction:.0%}, {tol.rss_bytes // _MIB} MiB | "
            f"{tol.fds} fds | {tol.threads} threads)"
        )
        for role, metrics in self.levels().items():
            bad = [f"{m} {lv.why}" for m, lv in metrics.items() if not lv.flat]
            shown = ", ".join(f"{m} {_level_text(m, lv)}" for m, lv in metrics.items())
            self.checks.append(
                CheckResult(f"flat: {role}", not bad, expected, "; ".join(bad) or shown)
            )
        self.checks.append(
            CheckResult(
                "no leaks",
                not self.leaks,
                "tasks, processes, sockets, KV blocks",
                "; ".join(self.leaks) or "none",
            )
        )
        if self.error is not None:
            self.checks.insert(0, CheckResult("soak ran", False, "no error", self.error))
        self.passed = all(c.passed for c in self.checks)

    # -- JSON ---------------------------------------------------------------------------------

    def _resources(self, *, full: bool) -> dict[str, Any]:
        """Each role's processes and levels: in full (and every sample), or start/end/max (RSS
        in MiB) for the summary line."""
        pids = self.pids()
        out: dict[str, Any] = {}
        for role, metrics in self.levels().items():
            entry: dict[str, Any] = {"pids": pids.get(role, 0)}
            for m, lv in metrics.items():
                if full:
                    entry[m] = _rounded(lv.to_dict())
                elif m == "rss":
                    entry["rss_mib"] = [round(v / _MIB, 1) for v in (lv.start, lv.end, lv.max)]
                else:
                    entry[m] = [int(v) for v in (lv.start, lv.end, lv.max)]
            entry["flat"] = all(lv.flat for lv in metrics.values())
            if full and self.sampler is not None:
                entry["samples"] = [
                    [round(s.t, 2), s.pid, s.rss, s.fds, s.threads]
                    for s in self.sampler.series[role]
                ]
            out[role] = entry
        return out

    def summary(self) -> dict[str, Any]:
        """The final line: requests by outcome, faults, each role's start/end/max RSS, fds and
        threads, the verdict."""
        by_kind = Counter(f.kind for f in self.faults if f.injected)
        return {
            "soak": "passed" if self.passed else "failed",
            "backend": self.backend,
            "load_s": round(self.load_s, 1),
            "requests": {"total": self.tally.total, **self.tally.by_outcome},
            "faults": {
                "due": len(self.faults),
                "injected": self.faults_injected,
                "by_kind": dict(by_kind),
            },
            "samples": self.samples,
            "resources": self._resources(full=False),
            "failed_checks": [c.name for c in self.checks if not c.passed],
        }

    def to_dict(self) -> dict[str, Any]:
        """Everything: the summary, the checks, every fault, the requests by kind, the counters
        and every sample (``[t, pid, rss, fds, threads]``)."""
        faults = [{**_rounded(attrs.asdict(f)), "injected": f.injected} for f in self.faults]
        return {
            **self.summary(),
            "passed": self.passed,
            "config": {**attrs.asdict(self.config), "warmup_s": self.config.warmup},
            "checks": [attrs.asdict(c) for c in self.checks],
            "fault_records": faults,
            "requests_by_kind": {k: dict(v) for k, v in self.tally.by_kind.items()},
            "error_codes": dict(self.tally.error_codes),
            "lost_examples": list(self.tally.lost),
            "counters": self.counters,
            "resources": self._resources(full=True),
            "leaks": self.leaks,
            "error": self.error,
        }

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    # -- the terminal -------------------------------------------------------------------------

    def text(self, width: int = 160) -> str:
        """The rendered tables as plain text."""
        console = Console(file=io.StringIO(), width=width, color_system=None, record=True)
        self.render(console)
        return console.export_text()

    def render(self, console: Console) -> None:
        verdict = "[bold green]PASSED[/]" if self.passed else "[bold red]FAILED[/]"
        console.print(
            f"[bold]soak[/] ({self.backend}): {verdict} after {self.load_s:.0f} s of load, "
            f"{self.faults_injected} faults, {self.samples} samples"
        )
        requests = Table("kind", *OUTCOMES, title="requests", title_justify="left")
        for kind, counts in sorted(self.tally.by_kind.items()):
            requests.add_row(kind, *(str(counts[o]) for o in OUTCOMES))
        requests.add_row("[bold]all[/]", *(str(v) for v in self.tally.by_outcome.values()))
        console.print(requests)
        faults = Table("fault", "target", "due", "what happened", title="faults")
        faults.title_justify = "left"
        for f in self.faults:
            what = f"[red]{f.error}[/]" if f.error else f.detail
            faults.add_row(f.description, f.target, f"{f.at:.0f} s", what)
        console.print(faults)
        resources = Table(
            "role",
            "pids",
            "RSS MiB start/end/max",
            "fds",
            "threads",
            "flat",
            title="resources (start/end/max; early -> late level)",
            title_justify="left",
        )
        pids = self.pids()
        for role, m in self.levels().items():
            flat = all(lv.flat for lv in m.values())
            resources.add_row(
                role,
                str(pids.get(role, 0)),
                _level_text("rss", m["rss"]),
                _level_text("fds", m["fds"]),
                _level_text("threads", m["threads"]),
                "[green]yes[/]" if flat else "[red]NO[/]",
            )
        console.print(resources)
        checks = Table("", "check", "expected", "observed", title="checks", title_justify="left")
        for c in self.checks:
            checks.add_row(
                "[green]✓[/]" if c.passed else "[red]✗[/]", c.name, c.expected, c.observed
            )
        console.print(checks)
        shown = {k: v for k, v in self.counters.items() if v}
        console.print("counters: " + ", ".join(f"{k}={v:g}" for k, v in shown.items()))


def _rounded(data: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in data.items()}


def _level_text(metric: str, lv: Level) -> str:
    scale = _MIB if metric == "rss" else 1

    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value / scale:.0f}"

    return f"{fmt(lv.start)}/{fmt(lv.end)}/{fmt(lv.max)}; {fmt(lv.early)} -> {fmt(lv.late)}"
