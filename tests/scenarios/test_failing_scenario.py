"""A scenario whose expectations cannot hold fails, with a report a person can read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scenarios import Bound, Expect, Scenario, ScenarioFailed, Workload, run, topology


def test_an_impossible_expectation_fails_with_a_readable_report(tmp_path: Path) -> None:
    scenario = Scenario(
        name="expects-the-impossible",
        description="no fault at all, yet a restart and streams without a gap are expected",
        topology=topology(decode_workers=1),
        workload=Workload(clients=2, requests_per_client=2, max_tokens=32),
        expect=Expect(max_token_gap_s=0.0, counters={"engine_restarts": Bound(min=1)}),
        settle_s=0.5,
    )
    report = run(scenario, plot=tmp_path / "timeline.png")
    assert not report.passed
    failed = {c.name for c in report.failed_checks()}
    assert failed == {"max token gap", "engine_restarts"}, report.failed_checks()
    # What held still says so: the run itself was sound.
    assert {"success rate", "tokens match baseline", "no leaks"} <= {
        c.name for c in report.checks if c.passed
    }
    with pytest.raises(ScenarioFailed) as raised:
        report.assert_passed()
    message = str(raised.value)
    assert "expects-the-impossible (asyncio): FAILED" in message
    assert "✗ │ engine_restarts" in message and ">= 1" in message
    assert "✗ │ max token gap" in message and "<= 0 s" in message
    assert "✓ │ success rate" in message
    data = json.loads(report.to_json())
    assert data["passed"] is False and data["scenario"] == "expects-the-impossible"
    assert (tmp_path / "timeline.png").read_bytes().startswith(b"\x89PNG")
