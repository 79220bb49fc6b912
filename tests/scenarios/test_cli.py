"""``actorserve scenario``: list, and run from a file with a JSON report and a plot."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from actors.serving.cli import app


def test_list_shows_the_library() -> None:
    result = CliRunner().invoke(app, ["scenario", "list"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "decode-killed-mid-stream" in result.output
    assert "cancel-queued" in result.output


def test_run_a_file_writes_report_and_plot(tmp_path: Path) -> None:
    path = tmp_path / "burst.yaml"
    path.write_text(
        "name: burst\n"
        "topology: {decode_workers: 1, max_inflight: 2}\n"
        "workload: {clients: 1, requests_per_client: 3, max_tokens: 16}\n"
        "faults: [{kind: burst, requests: 8, at: 0.0}]\n"
        "expect: {counters: {rejections: {min: 1}}}\n"
    )
    report, plot = tmp_path / "report.json", tmp_path / "plot.png"
    result = CliRunner().invoke(
        app,
        ["scenario", "run", str(path), "--report", str(report), "--plot", str(plot)],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    assert "burst (asyncio): PASSED" in result.output
    data = json.loads(report.read_text())
    assert data["passed"] is True
    assert data["counters"]["rejections"] >= 1
    assert any(r["group"] == "burst" and r["status"] == 503 for r in data["requests"])
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_run_an_unknown_scenario_exits_2() -> None:
    result = CliRunner().invoke(app, ["scenario", "run", "no-such-thing"])
    assert result.exit_code == 2
    assert "no such scenario" in result.output
