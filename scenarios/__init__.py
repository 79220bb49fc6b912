"""Fault-injection scenarios: topology + workload + timed faults + expectations.

A scenario starts the serving tree (mock engines in child processes, HTTP on 127.0.0.1), runs its
workload once fault-free (the baseline), then again with its faults, and checks what must hold:
success rate, token-for-token equality with the baseline, the longest silence a client saw,
recovery time, migrations, cancellations and restarts counted from ``/metrics``, escalation or
not, and no leaked tasks, processes, sockets or KV blocks.

From Python or pytest::

    from scenarios import Bound, Expect, KillEngine, Scenario, Workload, run_scenario, topology

    async def test_my_service_survives_a_kill() -> None:
        scenario = Scenario(
            name="my-kill",
            topology=topology(decode_workers=2),
            workload=Workload(clients=4, max_tokens=96),
            faults=[KillEngine(at=0.1, when_busy=1)],
            expect=Expect(counters={"migrations": Bound(min=1)}),
        )
        (await run_scenario(scenario)).assert_passed()

From the shell: ``actorserve scenario list``, ``actorserve scenario run NAME|FILE
[--report out.json] [--plot out.png]``. Files are TOML or YAML (see ``load_scenario``).

The soak (``actorserve scenario soak``, or ``run_soak(SoakConfig(...))``) runs mixed load for
a long time with a fault every period, and checks that no request is lost and that memory,
descriptors and threads stay flat.
"""

from typing import TYPE_CHECKING, Any

# The package loads lazily: ``actorserve --help`` imports ``scenarios._cli``, and must not pay for
# the serving stack until a scenario runs.
if TYPE_CHECKING:
    from scenarios._faults_model import (
        FAULT_KINDS,
        Burst,
        CancelRequest,
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
    from scenarios._inject import FaultRecord
    from scenarios._library import LIBRARY, get_scenario, library
    from scenarios._lifecycle import DrainAndUndrain, ReleaseAndResume, RollingRelease, SignalRoot
    from scenarios._load import load_scenario, scenario_from_dict
    from scenarios._metrics import COUNTERS
    from scenarios._model import FAST_ENGINE, Bound, Expect, Scenario, Workload, topology
    from scenarios._plot import plot_timeline
    from scenarios._report import CheckResult, Report, RequestSummary, ScenarioFailed
    from scenarios._runner import run, run_scenario
    from scenarios._soak import run_soak
    from scenarios._soak_report import SoakConfig, SoakReport
    from scenarios._workload import RequestRecord

_LAZY = {
    "Bound": "scenarios._model",
    "Burst": "scenarios._faults_model",
    "COUNTERS": "scenarios._metrics",
    "CancelRequest": "scenarios._faults_model",
    "CheckResult": "scenarios._report",
    "CrashEngine": "scenarios._faults_model",
    "CrashLoop": "scenarios._faults_model",
    "DrainAndUndrain": "scenarios._lifecycle",
    "DropPublisher": "scenarios._faults_model",
    "Expect": "scenarios._model",
    "FAST_ENGINE": "scenarios._model",
    "FAULT_KINDS": "scenarios._faults_model",
    "FailCanaries": "scenarios._faults_model",
    "FailGenerate": "scenarios._faults_model",
    "FailKvTransfer": "scenarios._faults_model",
    "Fault": "scenarios._faults_model",
    "FaultRecord": "scenarios._inject",
    "HangEngine": "scenarios._faults_model",
    "KillEngine": "scenarios._faults_model",
    "LIBRARY": "scenarios._library",
    "Report": "scenarios._report",
    "ReleaseAndResume": "scenarios._lifecycle",
    "RequestRecord": "scenarios._workload",
    "RollingRelease": "scenarios._lifecycle",
    "RequestSummary": "scenarios._report",
    "Scenario": "scenarios._model",
    "ScenarioFailed": "scenarios._report",
    "SignalRoot": "scenarios._lifecycle",
    "SlowEngine": "scenarios._faults_model",
    "SoakConfig": "scenarios._soak_report",
    "SoakReport": "scenarios._soak_report",
    "StallEngine": "scenarios._faults_model",
    "Workload": "scenarios._model",
    "get_scenario": "scenarios._library",
    "library": "scenarios._library",
    "load_scenario": "scenarios._load",
    "plot_timeline": "scenarios._plot",
    "run": "scenarios._runner",
    "run_scenario": "scenarios._runner",
    "run_soak": "scenarios._soak",
    "scenario_from_dict": "scenarios._load",
    "topology": "scenarios._model",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "COUNTERS",
    "FAST_ENGINE",
    "FAULT_KINDS",
    "LIBRARY",
    "Bound",
    "Burst",
    "CancelRequest",
    "CheckResult",
    "CrashEngine",
    "CrashLoop",
    "DrainAndUndrain",
    "DropPublisher",
    "Expect",
    "FailCanaries",
    "FailGenerate",
    "FailKvTransfer",
    "Fault",
    "FaultRecord",
    "HangEngine",
    "KillEngine",
    "ReleaseAndResume",
    "Report",
    "RequestRecord",
    "RequestSummary",
    "RollingRelease",
    "Scenario",
    "ScenarioFailed",
    "SignalRoot",
    "SlowEngine",
    "SoakConfig",
    "SoakReport",
    "StallEngine",
    "Workload",
    "get_scenario",
    "library",
    "load_scenario",
    "plot_timeline",
    "run",
    "run_scenario",
    "run_soak",
    "scenario_from_dict",
    "topology",
]
