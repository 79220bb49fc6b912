"""The embedding examples (``docs/examples``) run as programs of their own: messages, a stream,
a crash and its restart, then a clean shutdown and exit code 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["embed_asyncio.py", "embed_trio.py"])
def test_embedding_example(script: str) -> None:
    backend = script.removesuffix(".py").rsplit("_", 1)[1]
    done = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "examples" / script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    ours = [line for line in lines if not line.startswith("20")]  # structlog lines carry a date
    assert "children: greeter, counter, flaky" in ours
    assert f"greeter: hello, {backend}" in ours
    assert "countdown: [3, 2, 1]" in ours
    assert sum(line.endswith("told the counter 10 times") for line in ours) == 3
    assert "counter: 30" in ours
    assert "flaky crashed: error: RuntimeError: flaky went boom" in ours
    assert "flaky after restart: fine" in ours
    assert "flaky: incarnation 2, restarts 1" in ours
    assert ours.count("flaky: started") == 2
    assert ours[-2:] == ["flaky: stopping (shutdown)", "stopped cleanly"]
    # The supervisor reported the crash as a warning (its structured log).
    assert any("exited" in line and "abnormal=True" in line for line in lines)
    assert "Traceback" not in done.stderr
