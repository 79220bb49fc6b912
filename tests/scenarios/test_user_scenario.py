"""Scenarios written the way a user writes their own: declare, run, assert."""

from __future__ import annotations

from pathlib import Path

from scenarios import (
    Bound,
    Expect,
    KillEngine,
    Scenario,
    Workload,
    load_scenario,
    run_scenario,
    topology,
)


async def test_my_deployment_survives_losing_a_worker_mid_stream() -> None:
    scenario = Scenario(
        name="my-two-workers-lose-one",
        topology=topology(
            decode_workers=2, router="round_robin", engine_args={"timing": {"speedup": 5.0}}
        ),
        workload=Workload(clients=3, requests_per_client=2, max_tokens=120),
        faults=[KillEngine(worker="busiest", when_busy=1, at=0.05)],
        expect=Expect(
            max_token_gap_s=5.0,
            counters={"migrations": Bound(min=1), "engine_restarts": Bound(min=1)},
        ),
    )
    report = await run_scenario(scenario)
    report.assert_passed()


async def test_a_scenario_from_a_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "cancel-and-slow.toml"
    path.write_text(
        """
        description = "a slow worker and a client that hangs up mid-stream"

        [topology]
        decode_workers = 1
        [topology.engine_args]
        timing = { speedup = 10.0 }

        [workload]
        clients = 2
        requests_per_client = 2
        max_tokens = 48

        [[faults]]
        kind = "slow"
        worker = "decode-0"
        factor = 3.0

        [[faults]]
        kind = "cancel"
        phase = "decode"
        at = 0.05

        [expect]
        [expect.counters]
        cancellations = { min = 1 }
        migrations = 0
        """
    )
    scenario = load_scenario(path)
    assert scenario.name == "cancel-and-slow"
    (await run_scenario(scenario)).assert_passed()
