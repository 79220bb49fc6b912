"""The soak, short: mixed load on the disaggregated tree with a fault every few seconds; nothing
is lost, memory, descriptors and threads stay flat, and every check ran on real numbers (the
30-minute soak runs outside the suite: ``actorserve scenario soak``)."""

from __future__ import annotations

from typer.testing import CliRunner

from actors.serving.cli import app
from scenarios import SoakConfig, run_soak


async def test_a_short_soak_passes_with_its_checks_exercised() -> None:
    report = await run_soak(SoakConfig(duration_s=10.0, fault_every_s=3.0, sample_every_s=0.5))
    assert report.passed, report.text()
    summary = report.summary()
    requests = summary["requests"]
    assert requests["ok"] > 0
    assert requests["total"] == sum(v for k, v in requests.items() if k != "total")
    # Every kind of request was sent: streamed or not, chat and completions, hang-ups, malformed.
    kinds = {"chat", "chat-stream", "completion", "completion-stream", "cancel", "bad"}
    assert kinds <= set(report.tally.by_kind)
    assert requests["invalid"] > 0
    faults = summary["faults"]
    assert faults["injected"] == faults["due"] >= 3
    assert {"kill", "stall"} <= set(faults["by_kind"])
    # Every role was sampled, its levels judged from samples after the warm-up.
    assert report.samples > 0
    levels = report.levels()
    assert {"root", "prefill-0", "decode-0", "decode-1"} <= set(levels)
    for metrics in levels.values():
        assert all(lv.early is not None and lv.late is not None for lv in metrics.values())
    assert sum(n > 1 for n in report.pids().values()) >= 1  # a killed engine came back


def test_the_soak_command_refuses_a_run_of_no_time() -> None:
    result = CliRunner().invoke(app, ["scenario", "soak", "--minutes", "0"])
    assert result.exit_code == 2
    assert "bad soak options" in result.output
