"""Running a scenario: start the serving tree, run the workload fault-free, then again with the
faults, count, check, and look for leaks once the tree is gone."""

from __future__ import annotations

import functools
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import attrs
import httpx
import sniffio

import scenarios._lifecycle  # noqa: F401  (the lifecycle faults' injectors)
from actors.serving import ServeConfig, Serving
from actors.serving.root import Budgets, RootOptions, serving_children
from scenarios._checks import client_counters, evaluate, recovery_time
from scenarios._faults_model import CrashLoop
from scenarios._inject import FaultRecord, Target, inject
from scenarios._leaks import Snapshot, leaks_since
from scenarios._metrics import COUNTERS, Sample, counters, scrape
from scenarios._model import Scenario
from scenarios._report import CheckResult, Report, RequestSummary
from scenarios._subprocess import open_root_process
from scenarios._workload import Clock, RequestRecord, run_workload
from supervisors import SupervisorFlags, SupervisorRef, open_supervisor

__all__ = ["kv_leaks", "open_tree", "run", "run_scenario"]

_START_TIMEOUT_S = 60.0
_IDLE_TIMEOUT_S = 5.0
# A prefill may owe KV to a decode worker that died before claiming it: the pages are held until
# the bootstrap timeout (actors.serving.kv.KVConfig.bootstrap_timeout, 30 s) ends the room. A
# bounded hold, not a leak; the report says how long the engines took to be idle ("kv_idle").
DISAGG_IDLE_TIMEOUT_S = 35.0


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
    root_exit_code: int | None = None  # of a root in its own process


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
            config = _prepared(scenario, Path(tmp))
            await _serve_and_load(scenario, config, run, report, Path(tmp))
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
        # Each engine counts its failed starts down in its worker's file (none: start normally).
        path = tmp / "fail-starts-{worker}"
        config = attrs.evolve(
            config, engine_args={**config.engine_args, "fail_start_file": str(path)}
        )
    return config


_BUDGETS = Budgets(grace=0.2, release_grace=0.0, drain=10.0, transfers=10.0, cleanup=10.0)


@asynccontextmanager
async def open_tree(serving: Serving) -> AsyncIterator[SupervisorRef]:
    """The serving tree in this process: the root's children (lifecycle included), as
    ``actorserve run`` has them; entered once every worker is routable."""
    children = serving_children(serving, RootOptions(budgets=_BUDGETS), lambda: None)
    async with open_supervisor(
        children, SupervisorFlags(intensity=10, period=60), name="root"
    ) as root_ref:
        with anyio.fail_after(_START_TIMEOUT_S):
            await serving.wait_routable()
        yield root_ref


async def _serve_and_load(
    scenario: Scenario, config: ServeConfig, run: _Run, report: Report, tmp: Path
) -> None:
    serving = Serving(config)
    workers = len(serving.roles)
    t = time.monotonic()
    if scenario.process == "subprocess":
        backend = sniffio.current_async_library()
        async with open_root_process(config, tmp, backend, _START_TIMEOUT_S) as root:
            report.durations["startup"] = time.monotonic() - t

            def in_subprocess(client: httpx.AsyncClient) -> Target:
                return Target(
                    root=None,
                    serving=serving,
                    client=client,
                    clock=Clock(),
                    workload=scenario.workload,
                    root_process=root,
                )

            await _load(scenario, in_subprocess, run, report, root.url, lambda: True)
        run.leaks += root.survivors()
        run.root_exit_code = root.exit_code
        return
    async with open_tree(serving) as root_ref:
        report.durations["startup"] = time.monotonic() - t

        def in_process(client: httpx.AsyncClient) -> Target:
            return Target(
                root=root_ref,
                serving=serving,
                client=client,
                clock=Clock(),
                workload=scenario.workload,
                fail_start_file=_fail_file(config),
            )

        url = f"http://{config.host}:{serving.port}"
        target = await _load(
            scenario, in_process, run, report, url, lambda: serving.routable() >= workers
        )
        if serving.routable() < workers:
            run.leaks.append(
                f"only {serving.routable()}/{workers} workers routable "
                f"{scenario.settle_s:g} s after the load"
            )
        t = time.monotonic()
        disaggregated = config.mode == "disaggregated"
        run.leaks += await kv_leaks(
            target,
            list(serving.roles),
            DISAGG_IDLE_TIMEOUT_S if disaggregated else _IDLE_TIMEOUT_S,
        )
        report.durations["kv_idle"] = time.monotonic() - t


async def _load(
    scenario: Scenario,
    make_target: Callable[[httpx.AsyncClient], Target],
    run: _Run,
    report: Report,
    url: str,
    healed: Callable[[], bool],
) -> Target:
    """Baseline, then the workload with the faults, then the counts once the tree healed."""
    model = scenario.topology.model
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, limits=limits) as client:
        if scenario.baseline:
            clock = Clock()
            run.baseline = await run_workload(client, scenario.workload, model, clock)
            run.baseline_s = report.durations["baseline"] = clock.now()
        start = await scrape(client)
        target = make_target(client)
        records: list[FaultRecord | None] = [None] * len(scenario.faults)

        async def fault(i: int) -> None:
            records[i] = await inject(scenario.faults[i], target)

        async with anyio.create_task_group() as tg:
            for i in range(len(scenario.faults)):
                tg.start_soon(fault, i)
            run.workload = await run_workload(client, scenario.workload, model, target.clock)
            run.faulted_s = target.clock.now()
        report.durations["faulted"] = target.clock.now()
        run.faults = [r for r in records if r is not None]
        run.extra = target.extra
        root = target.root_process
        if root is None or root.process.returncode is None:
            run.counters = await _settled(scenario, client, start, healed)
        # else: the root is gone, nothing left to count
    return target


async def _settled(
    scenario: Scenario, client: httpx.AsyncClient, start: Sample, healed: Callable[[], bool]
) -> dict[str, float]:
    """The counts once the tree has healed: every worker routable and every expected count
    reached, or ``settle_s`` gone. What follows a fault may outlast the load (a health checker
    fails a worker after its canaries time out, a restart waits out its backoff)."""
    bounds = {k: b for k, b in scenario.expect.counters.items() if k in COUNTERS}
    with anyio.move_on_after(scenario.settle_s):
        while True:
            counts = counters(start, await scrape(client))
            if healed() and all(b.holds(counts[k]) for k, b in bounds.items()):
                return counts
            await anyio.sleep(0.1)
    return counters(start, await scrape(client))


def _fail_file(config: ServeConfig) -> Path | None:
    path = config.engine_args.get("fail_start_file")
    return Path(path) if path else None


async def kv_leaks(target: Target, workers: list[str], timeout: float) -> list[str]:
    """Engines still holding requests or KV blocks ``timeout`` s after every client is done."""
    leaks: list[str] = []
    with anyio.move_on_after(timeout):
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
    report.root_exit_code = run.root_exit_code
    report.checks = evaluate(
        scenario.expect,
        root_exit_code=run.root_exit_code,
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
