"""The soak (``actorserve scenario soak``): mixed load for a long time with a fault every period,
checking that nothing is lost and that memory, descriptors and threads stay flat.

The serving tree is the scenarios' own (``scenarios._runner.open_tree``: mock engines in child
processes, disaggregated with one prefill and two decode workers), faults are the scenarios'
fault kinds carried out by ``scenarios._inject``, one per period in a fixed cycle; the load is
``scenarios._soak_load``'s, the samples and the flatness rule ``scenarios._soak_resources``', the
configuration and the report ``scenarios._soak_report``'s.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import attrs
import httpx
import sniffio

from actors.serving import ServeConfig, Serving
from scenarios._faults_model import (
    Burst,
    CrashEngine,
    CrashLoop,
    DropPublisher,
    FailCanaries,
    FailGenerate,
    FailKvTransfer,
    Fault,
    HangEngine,
    KillEngine,
    SlowEngine,
    StallEngine,
)
from scenarios._inject import Target, inject
from scenarios._leaks import Snapshot, leaks_since
from scenarios._lifecycle import DrainAndUndrain, ReleaseAndResume, RollingRelease
from scenarios._metrics import counters, scrape
from scenarios._model import Workload, topology
from scenarios._runner import DISAGG_IDLE_TIMEOUT_S, kv_leaks, open_tree
from scenarios._soak_load import run_load
from scenarios._soak_report import SoakConfig, SoakReport
from scenarios._soak_resources import Sampler
from scenarios._workload import Clock

__all__ = ["fault_cycle", "run_soak", "soak", "soak_topology"]

_MIB = 1 << 20


def soak_topology(fail_start_file: Path) -> ServeConfig:
    """Disaggregated (one prefill, two decode workers), mock engines at a 5x speed-up, a
    frontend admitting 16 requests at a time (a burst is partly refused)."""
    return topology(
        mode="disaggregated",
        prefill_workers=1,
        decode_workers=2,
        max_inflight=16,
        engine_args={"timing": {"speedup": 5.0}, "fail_start_file": str(fail_start_file)},
    )


def fault_cycle(period: float) -> tuple[Fault, ...]:
    """The faults a soak injects, one per period, in this order (then again from the first);
    durations scale with the period so each fault is over before the next is due."""
    wait = min(10.0, period / 2)

    def decode(cls: Callable[..., Fault], **fields: Any) -> Fault:
        return cls(worker="busiest-decode", when_busy=1, wait_s=wait, **fields)

    def prefill(cls: Callable[..., Fault], **fields: Any) -> Fault:
        # A prefill runs for milliseconds: waiting for one to be caught running could miss.
        return cls(worker="busiest-prefill", wait_s=wait, **fields)

    return (
        decode(KillEngine),
        prefill(KillEngine),
        decode(StallEngine, duration_s=min(3.0, period * 0.6)),  # past the heartbeat timeout
        decode(CrashLoop, failures=2),
        decode(DropPublisher),
        Burst(requests=24),
        decode(CrashEngine),
        decode(KillEngine, signal="SIGTERM"),
        decode(FailKvTransfer, count=2),
        decode(FailKvTransfer, count=2, corrupt=True),
        decode(FailGenerate, count=3),
        decode(HangEngine, duration_s=min(3.0, period * 0.5)),
        decode(SlowEngine, factor=5.0, duration_s=period * 0.5),
        decode(StallEngine, duration_s=min(1.0, period * 0.2)),  # within the heartbeat timeout
        decode(FailCanaries, count=2),
        decode(DrainAndUndrain, undrain_after_s=min(2.0, period * 0.2)),
        decode(ReleaseAndResume, resume_after_s=min(2.0, period * 0.2)),
        RollingRelease(pool="decode"),
        prefill(KillEngine, signal="SIGTERM"),
    )


# -- the run ----------------------------------------------------------------------------------


async def run_soak(
    config: SoakConfig, *, progress: Callable[[str], None] | None = None
) -> SoakReport:
    """Soak the serving tree in this event loop (asyncio or trio); ``progress`` gets a line
    per fault. A soak that breaks (the tree does not start) is a failed report."""
    report = SoakReport(config=config, backend=sniffio.current_async_library())
    before = Snapshot.take()
    routable: str | None = None
    with tempfile.TemporaryDirectory(prefix="actorserve-soak-") as tmp:
        try:
            routable = await _serve_and_soak(config, Path(tmp), report, progress or _quiet)
        except Exception as exc:
            report.error = f"{type(exc).__name__}: {exc}"
        report.leaks += await leaks_since(before)
    report.judge(routable)
    return report


def soak(
    config: SoakConfig,
    *,
    backend: str = "asyncio",
    progress: Callable[[str], None] | None = None,
) -> SoakReport:
    """:func:`run_soak` in a fresh event loop of ``backend`` (``asyncio`` or ``trio``)."""
    return anyio.run(functools.partial(run_soak, config, progress=progress), backend=backend)


def _quiet(line: str) -> None:
    """No progress lines."""


async def _serve_and_soak(
    config: SoakConfig, tmp: Path, report: SoakReport, progress: Callable[[str], None]
) -> str:
    """Serve, soak, settle; what is not routable after the load ("" when all are)."""
    fail_file = tmp / "fail-starts-{worker}"  # each engine counts its failed starts down in its own
    serving = Serving(soak_topology(fail_file))
    workers = list(serving.roles)
    async with open_tree(serving) as root:
        url = f"http://{serving.config.host}:{serving.port}"
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=url, limits=limits) as client:
            start = await scrape(client)
            clock = Clock()
            target = Target(
                root=root,
                serving=serving,
                client=client,
                clock=clock,
                workload=Workload(max_tokens=64),
                fail_start_file=fail_file,
            )
            report.sampler = sampler = Sampler(target, clock)
            end = config.duration_s
            async with anyio.create_task_group() as tg:
                tg.start_soon(sampler.run, end, config.sample_every_s)
                tg.start_soon(_faults, config, target, report, progress)
                await run_load(
                    client,
                    serving.config.model,
                    report.tally,
                    clock,
                    until=end,
                    clients=config.clients,
                    seed=config.seed,
                )
            report.load_s = clock.now()
            progress(f"[{clock.now():7.1f} s] load over: {_so_far(report)}; settling")
            with anyio.move_on_after(config.settle_s):
                while serving.routable() < len(workers):  # noqa: ASYNC110
                    await anyio.sleep(0.1)  # routability has no event to wait on
            routable = serving.routable()
            report.leaks += await kv_leaks(target, workers, DISAGG_IDLE_TIMEOUT_S)
            report.counters = counters(start, await scrape(client))
    return "" if routable == len(workers) else f"{routable}/{len(workers)} routable"


async def _faults(
    config: SoakConfig, target: Target, report: SoakReport, progress: Callable[[str], None]
) -> None:
    """One fault per period while the load runs, cycling through :func:`fault_cycle`."""
    cycle = fault_cycle(config.fault_every_s)
    n = 1
    while n * config.fault_every_s < config.duration_s:
        fault = attrs.evolve(cycle[(n - 1) % len(cycle)], at=n * config.fault_every_s)
        record = await inject(fault, target)
        report.faults.append(record)
        # The requests a fault sent itself (a burst's) count with the load's.
        for request in target.extra:
            report.tally.add_record(request)
        target.extra.clear()
        what = f"error: {record.error}" if record.error else record.detail
        progress(
            f"[{target.clock.now():7.1f} s] fault {n} {record.description} on {record.target}: "
            f"{what}; {_so_far(report)}"
        )
        n += 1


def _so_far(report: SoakReport) -> str:
    outcomes = report.tally.by_outcome
    root = report.sampler.series["root"] if report.sampler is not None else []
    rss = f", root RSS {root[-1].rss / _MIB:.0f} MiB" if root else ""
    return f"{report.tally.total} requests ({outcomes['ok']} ok, {outcomes['lost']} lost){rss}"
