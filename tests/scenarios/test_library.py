"""Every library scenario passes (once, on asyncio: the library is the slow part of the suite;
tests/scenarios/test_user_scenario.py runs a scenario on both backends)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scenarios import LIBRARY, get_scenario, run


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LIBRARY))
def test_library_scenario_passes(name: str, tmp_path: Path) -> None:
    report = run(get_scenario(name), backend="asyncio")
    if not report.passed:
        # What a failure leaves to look at, besides the summary in the assertion message.
        report.save_json(tmp_path / f"{name}.json")
    report.assert_passed()


def test_the_library_covers_the_failures_users_fear() -> None:
    kinds = {fault.kind for scenario in LIBRARY.values() for fault in scenario.faults}
    assert len(LIBRARY) >= 12
    assert {
        "kill",
        "stall",
        "crash",
        "hang",
        "slow",
        "fail_canaries",
        "drop_publisher",
        "crash_loop",
        "cancel",
        "burst",
        "release",
        "rolling_release",
        "drain",
        "signal_root",
        "kv_transfer",
    } <= kinds
    modes = {scenario.topology.mode for scenario in LIBRARY.values()}
    assert modes == {"aggregated", "disaggregated"}
    phases = {
        f.phase
        for s in LIBRARY.values()
        for f in s.faults
        if f.kind == "cancel"  # type: ignore[attr-defined]
    }
    assert phases == {"queued", "prefill", "decode"}
