"""Running a scenario: start the serving tree, run the workload fault-free, then again with the
faults, count, check, and look for leaks once the tree is gone."""

from __future__ import annotations

import functools
import tempfile
import time
from pathlib import Path

import anyio
import attrs
import httpx
import sniffio

from actors.serving import ServeConfig, Serving, build_tree
from scenarios._checks import client_counters, evaluate, recovery_time
from scenarios._faults_model import CrashLoop
from scenarios._inject import FaultRecord, Target, inject
from scenarios._leaks import Snapshot, leaks_since
from scenarios._metrics import COUNTERS, Sample, counters, scrape
from scenarios._model import Scenario
from scenarios._report import CheckResult, Report, RequestSummary
from scenarios._workload import Clock, RequestRecord, run_workload
from supervisors import SupervisorFlags, open_supervisor

__all__ = ["run", "run_scenario"]

_START_TIMEOUT_S = 60.0
_IDLE_TIMEOUT_S = 5.0


@attrs.define
class _Run:
    """What the run collected, for the checks."""

    baseline: list[RequestRecord] | None = None
    workload: list[RequestRecord] = attrs.field(factory=list)
    extra: list[RequestRecord] = attrs.field(factory=list)
    faults: list[FaultRecord] = attrs.field(factory=list)
    counters: dict[str, float] = attrs.field(factory=dict)
    leaks: list[str] = attrs.field(factory=list)
    faulted_s: float = 0.0
    baseline_s: float = 0.0


async def run_scenario(scenario: Scenario, *, plot: str | Path | None = None) -> Report:
    """Run ``scenario`` in this event loop (asyncio or trio) and report on it.

    The serving tree runs here, its engines in child processes, on 127.0.0.1. A run that
    breaks (the tree does not start, the root escalates) is a failed report, not an exception.
    ``plot`` also writes the timeline PNG there.
    """
    began = time.monotonic()
    report = Report(
        scenario=scenario.name,
        description=scenario.description,
        backend=sniffio.current_async_library(),
    )
    before = Snapshot.take()
    run = _Run()
    with tempfile.TemporaryDirectory(prefix="actorserve-scenario-") as tmp:
        try:
            await _serve_and_load(scenario, _prepared(scenario, Path(tmp)), run, report)
        except Exception as exc:
            report.error = f"{type(exc).__name__}: {exc}"
        stopped = time.monotonic()
        run.leaks += await leaks_since(before)
    report.durations["shutdown"] = time.monotonic() - stopped
    report.durations["total"] = time.monotonic() - began
    _judge(scenario, run, report)
    if plot is not None:
        from scenarios._plot import plot_timeline

        plot_timeline(report, plot)
    return report


def run(scenario: Scenario, *, backend: str = "asyncio", plot: str | Path | None = None) -> Report:
    """:func:`run_scenario` in a fresh event loop of ``backend`` (``asyncio`` or ``trio``)."""
    return anyio.run(functools.partial(run_scenario, scenario, plot=plot), backend=backend)


def _prepared(scenario: Scenario, tmp: Path) -> ServeConfig:
    config = scenario.topology
    if any(isinstance(f, CrashLoop) for f in scenario.faults) and config.backend == "mock":
        # The engines count their failed starts down in this file (0: start normally).
        path = tmp / "fail-starts"
        path.write_text("0")
        config = attrs.evolve(
            config, engine_args={**config.engine_args, "fail_start_file": str(path)}
        )
    return config


async def _serve_and_load(
    scenario: Scenario, config: ServeConfig, run: _Run, report: Report
) -> None:
    serving = Serving(config)
    workers = len(serving.roles)
    t = time.monotonic()
    async with open_supervisor(
        build_tree(serving), SupervisorFlags(intensity=10, period=60), name="root"
    ) as root:
        with anyio.fail_after(_START_TIMEOUT_S):
            await serving.table.wait_routable(workers)
        report.durations["startup"] = time.monotonic() - t
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
        async with httpx.AsyncClient(
            base_url=f"http://{config.host}:{serving.port}", limits=limits
        ) as client:
            if scenario.baseline:
                clock = Clock()
                run.baseline = await run_workload(client, scenario.workload, config.model, clock)
                run.baseline_s = clock.now()
                report.durations["baseline"] = run.baseline_s
            start = await scrape(client)
            clock = Clock()
            target = Target(
                root=root,
                serving=serving,
                client=client,
                clock=clock,
                workload=scenario.workload,
                fail_start_file=_fail_file(config),
            )
            records: list[FaultRecord | None] = [None] * len(scenario.faults)

            async def fault(i: int) -> None:
                records[i] = await inject(scenario.faults[i], target)

            async with anyio.create_task_group() as tg:
                for i in range(len(scenario.faults)):
                    tg.start_soon(fault, i)
                run.workload = await run_workload(client, scenario.workload, config.model, clock)
                run.faulted_s = clock.now()
            report.durations["faulted"] = clock.now()
            run.faults = [r for r in records if r is not None]
            run.extra = target.extra
            run.counters = await _settled(scenario, serving, client, start)
            if serving.table.routable() < workers:
                run.leaks.append(
                    f"only {serving.table.routable()}/{workers} workers routable "
                    f"{scenario.settle_s:g} s after the load"
                )
            run.leaks += await _kv_leaks(target, list(serving.roles))


async def _settled(
    scenario: Scenario, serving: Serving, client: httpx.AsyncClient, start: Sample
) -> dict[str, float]:
    """The counts once the tree has healed: every worker routable and every expected count
    reached, or ``settle_s`` gone. What follows a fault may outlast the load (a health checker
    fails a worker after its canaries time out, a restart waits out its backoff)."""
    workers = len(serving.roles)
    bounds = {k: b for k, b in scenario.expect.counters.items() if k in COUNTERS}
    with anyio.move_on_after(scenario.settle_s):
        while True:
            counts = counters(start, await scrape(client))
            healed = serving.table.routable() >= workers
            if healed and all(b.holds(counts[k]) for k, b in bounds.items()):
                return counts
            await anyio.sleep(0.1)
    return counters(start, await scrape(client))


def _fail_file(config: ServeConfig) -> Path | None:
    path = config.engine_args.get("fail_start_file")
    return Path(path) if path else None


async def _kv_leaks(target: Target, workers: list[str]) -> list[str]:
    """Engines still holding requests or KV blocks once every client is done."""
    leaks: list[str] = []
    with anyio.move_on_after(_IDLE_TIMEOUT_S):
        while True:
            leaks = []
            for worker in workers:
                stats = await target.stats(worker)
                if stats is None:
                    leaks.append(f"{worker}: engine not answering")
                elif stats.engine_in_flight > 0 or stats.kv_used_blocks > 0:
                    leaks.append(
                        f"{worker}: {stats.engine_in_flight} requests, "
                        f"{stats.kv_used_blocks} KV blocks still held"
                    )
            if not leaks:
                return []
            await anyio.sleep(0.05)
    return leaks


def _judge(scenario: Scenario, run: _Run, report: Report) -> None:
    summary = RequestSummary.of(run.workload, run.faulted_s)
    report.workload = summary
    if run.baseline is not None:
        report.baseline = RequestSummary.of(run.baseline, run.baseline_s)
    report.faults = run.faults
    report.requests = [*run.workload, *run.extra]
    report.counters = {**run.counters, **client_counters(run.workload, run.extra)}
    report.recovery_s = recovery_time(run.workload, run.faults)
    report.leaks = run.leaks
    report.checks = evaluate(
        scenario.expect,
        faults=run.faults,
        baseline=run.baseline,
        workload=run.workload,
        extra=run.extra,
        summary=summary,
        counters=report.counters,
        recovery_s=report.recovery_s,
        leaks=run.leaks,
    )
    if report.error is not None:
        report.checks.insert(0, CheckResult("scenario ran", False, "no error", report.error))
    report.passed = report.error is None and all(c.passed for c in report.checks)
