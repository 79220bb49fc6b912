"""Judging a run against its scenario's expectations."""

from __future__ import annotations

from collections.abc import Sequence

from scenarios._inject import FaultRecord
from scenarios._model import Expect
from scenarios._report import CheckResult, RequestSummary
from scenarios._workload import RequestRecord

__all__ = ["client_counters", "evaluate", "recovery_time"]


def client_counters(
    workload: Sequence[RequestRecord], extra: Sequence[RequestRecord]
) -> dict[str, float]:
    """What the clients counted: failed workload requests, 503s, deliberate disconnects."""
    everything = [*workload, *extra]
    return {
        "requests_failed": float(sum(not r.ok for r in workload)),
        "rejections": float(sum(r.rejections for r in everything)),
        "cancelled": float(sum(r.cancelled for r in everything)),
    }


def recovery_time(records: Sequence[RequestRecord], faults: Sequence[FaultRecord]) -> float | None:
    """From the first fault to the end of the first successful request sent after it (how long
    the service took to take and finish new work again); ``None`` without either."""
    times = [f.injected_at for f in faults if f.injected_at is not None]
    if not times:
        return None
    t = min(times)
    ends = [r.ended for r in records if r.ok and r.started >= t and r.ended is not None]
    return min(ends) - t if ends else None


def _first_difference(a: str, b: str) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _token_check(
    faulted: Sequence[RequestRecord], baseline: Sequence[RequestRecord]
) -> CheckResult:
    reference = {r.id: r for r in baseline}
    compared, differing = 0, []
    for r in faulted:
        base = reference.get(r.id)
        if not r.ok or base is None or not base.ok:
            continue
        compared += 1
        if r.text != base.text or r.completion_tokens != base.completion_tokens:
            at = _first_difference(r.text, base.text)
            differing.append(
                f"{r.id}: {r.completion_tokens} vs {base.completion_tokens} tokens, "
                f"text differs at char {at}"
            )
    observed = f"{compared - len(differing)}/{compared} identical"
    if differing:
        observed += "; " + "; ".join(differing[:3])
    return CheckResult("tokens match baseline", not differing, "every succeeded request", observed)


def evaluate(
    expect: Expect,
    *,
    faults: Sequence[FaultRecord],
    baseline: Sequence[RequestRecord] | None,
    workload: Sequence[RequestRecord],
    extra: Sequence[RequestRecord],
    summary: RequestSummary,
    counters: dict[str, float],
    recovery_s: float | None,
    leaks: Sequence[str],
    root_exit_code: int | None = None,
) -> list[CheckResult]:
    """Every check the expectations ask for, in a stable order."""
    checks: list[CheckResult] = []
    if expect.faults_injected and faults:
        missed = [f"{f.description}: {f.error}" for f in faults if not f.injected]
        checks.append(
            CheckResult(
                "faults injected",
                not missed,
                f"all {len(faults)}",
                "; ".join(missed) or f"{len(faults)}/{len(faults)}",
            )
        )
    failures = [f"{r.id}: {r.error or r.finish}" for r in workload if not r.ok]
    observed = f"{summary.succeeded}/{summary.requests} ({summary.success_rate:.0%})"
    if failures:
        observed += "; " + "; ".join(failures[:2])
    checks.append(
        CheckResult(
            "success rate",
            summary.success_rate >= expect.success_rate,
            f">= {expect.success_rate:.0%}",
            observed,
        )
    )
    if expect.allowed_errors and failures:
        untyped = [
            f"{r.id}: {r.error or r.finish}"
            for r in workload
            if not r.ok and not (r.error or "").startswith(expect.allowed_errors)
        ]
        checks.append(
            CheckResult(
                "typed errors",
                not untyped,
                " or ".join(expect.allowed_errors),
                "; ".join(untyped[:3]) or f"all {len(failures)} failures",
            )
        )
    if expect.tokens_match_baseline and baseline is not None:
        broken = [f"{r.id}: {r.error}" for r in baseline if not r.ok]
        if broken:
            checks.append(
                CheckResult("baseline clean", False, "every request ok", "; ".join(broken[:3]))
            )
        checks.append(_token_check(workload, baseline))
    if expect.max_token_gap_s is not None:
        checks.append(
            CheckResult(
                "max token gap",
                summary.max_token_gap_s <= expect.max_token_gap_s,
                f"<= {expect.max_token_gap_s:g} s",
                f"{summary.max_token_gap_s:.3f} s",
            )
        )
    if expect.max_recovery_s is not None:
        checks.append(
            CheckResult(
                "recovery time",
                recovery_s is not None and recovery_s <= expect.max_recovery_s,
                f"<= {expect.max_recovery_s:g} s",
                "never" if recovery_s is None else f"{recovery_s:.3f} s",
            )
        )
    for name, bound in expect.counters.items():
        value = counters.get(name)
        checks.append(
            CheckResult(
                name,
                value is not None and bound.holds(value),
                str(bound),
                "unknown counter" if value is None else f"{value:g}",
            )
        )
    if expect.escalation is not None:
        escalations = counters.get("escalations", 0.0)
        checks.append(
            CheckResult(
                "supervisor escalation",
                (escalations > 0) == expect.escalation,
                "yes" if expect.escalation else "none",
                f"{escalations:g}",
            )
        )
    refused = [r for r in [*workload, *extra] if r.rejections]
    if refused:
        missing = sum(v is None for r in refused for v in r.retry_after)
        checks.append(
            CheckResult(
                "503s carry Retry-After",
                missing == 0,
                "every 503",
                f"{sum(r.rejections for r in refused) - missing}/"
                f"{sum(r.rejections for r in refused)}",
            )
        )
    if expect.root_exit_code is not None:
        checks.append(
            CheckResult(
                "root exit code",
                root_exit_code == expect.root_exit_code,
                str(expect.root_exit_code),
                "still running" if root_exit_code is None else str(root_exit_code),
            )
        )
    if expect.no_leaks:
        checks.append(
            CheckResult(
                "no leaks",
                not leaks,
                "tasks, processes, sockets, KV blocks",
                "; ".join(leaks) or "none",
            )
        )
    return checks
