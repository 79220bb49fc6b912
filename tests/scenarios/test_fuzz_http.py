"""``actorserve scenario fuzz-http``: a short pass against a real root finds no server error."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from actors.serving.cli import app


def test_a_short_fuzz_pass_finds_no_server_error() -> None:
    result = CliRunner().invoke(
        app, ["scenario", "fuzz-http", "--cases", "100"], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["server_errors"] == 0, result.output
    assert summary["cases"] >= 90, summary
    assert sum(summary["status_counts"].values()) == summary["cases"]
    # Most bodies name the served model and are valid: the engines answer them.
    assert summary["status_counts"]["200"] >= summary["cases"] // 3, summary
