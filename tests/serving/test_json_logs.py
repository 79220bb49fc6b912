"""``actorserve run --log-format json`` as an operator runs it: every line it writes parses,
the engine processes log alike, and the lines about a request carry its id."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from actors.lowlevel import free_port
from tests.helpers.serving import start_root


def _wait_healthy(root: subprocess.Popen[str], port: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert root.poll() is None, "the root exited"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the root never became healthy")


def _mentions(line: dict[str, Any], value: str) -> bool:
    return any(v == value for v in line.values())


def test_json_lines_of_a_root_carry_request_ids(tmp_path: Path) -> None:
    config = tmp_path / "serve.toml"
    # The engine is made so slow that the request stalls: its request stream migrates it (a
    # line from the request path) and gives up.
    config.write_text("stall_timeout = 0.5\n")
    port = free_port()
    # The format from the environment; the port's variable loses to the flag.
    env = {**os.environ, "ACTORSERVE_LOG_FORMAT": "json", "ACTORSERVE_PORT": str(free_port())}
    root = start_root(
        port,
        *("--decode-workers", "1", "--grace-period", "0", "--log-level", "info"),
        *("--config", str(config), "--migration-limit", "1"),
        *("--engine-arg", 'timing={"speedup": 0.0005}'),
        env=env,
    )
    try:
        _wait_healthy(root, port)
        body = {"model": "mock", "messages": [{"role": "user", "content": "hi"}]}
        failed = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={**body, "max_tokens": 4},
            headers={"x-request-id": "ops-1"},
            timeout=60,
        )
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models")
        root.send_signal(signal.SIGTERM)
        out, _ = root.communicate(timeout=60)
    finally:
        if root.poll() is None:
            root.kill()
            root.communicate()
    assert root.returncode == 0, out
    assert failed.status_code >= 500 and failed.headers["x-request-id"] == "ops-1"
    assert len(models.headers["x-request-id"]) == 32

    lines = [json.loads(text) for text in out.splitlines() if text.strip()]
    assert lines
    for line in lines:
        assert isinstance(line, dict)
        assert {"timestamp", "level", "event", "logger"} <= set(line), line
    [ready] = [line for line in lines if line["event"] == "ready"]
    assert ready["url"] == f"http://127.0.0.1:{port}/v1"
    # The engine's own process logs in the same format.
    [engine] = [line for line in lines if line["event"] == "engine started"]
    assert engine["pid"] != root.pid and engine["worker"] == "decode-0"

    about = [line for line in lines if line.get("request_id") == "ops-1"]
    migrated = [line for line in about if line["event"] == "migrating request"]
    assert migrated and migrated[0]["logger"] == "actorserve.request"
    rid = migrated[0]["rid"]
    assert rid.startswith("chatcmpl-")
    # Every line that names the request names it by its id too.
    assert all(line.get("request_id") == "ops-1" for line in lines if _mentions(line, rid))
