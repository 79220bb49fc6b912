"""``actorserve workers``, ``drain``, ``undrain``, ``release`` and ``resume`` against a real root
(its own process, mock engines, its control API on): each finds the root through its control
socket, and the token the root wrote, as an operator's shell would; ``run --served-model-name``
names the model the root serves."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from functools import partial
from typing import Any

import anyio
import httpx
import pytest
from typer.testing import CliRunner, Result

from actors.lowlevel import free_port
from actors.serving.cli import app
from actors.serving.root import wait_healthy
from actors.serving.root._rundir import user_run_dir
from actors.testing import wait_until
from tests.helpers.serving import start_root

# The operator's environment names no token: the commands find the one the root wrote.
_NO_TOKEN: dict[str, str | None] = {"ACTORSERVE_CONTROL_TOKEN": None}


def _cli(*args: str, env: dict[str, str | None] | None = None) -> Result:
    return CliRunner().invoke(app, list(args), env={**_NO_TOKEN, **(env or {})})


def _states() -> dict[str, Any]:
    result = _cli("workers", "--json")
    assert result.exit_code == 0, result.output
    states: dict[str, Any] = json.loads(result.stdout)
    return states


@pytest.fixture
def root() -> Iterator[tuple[int, int]]:
    """A root serving the mock as ``foo`` on two aggregated workers: its HTTP and control API
    ports, once its control socket listens."""
    port, api_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "ACTORSERVE_CONTROL_TOKEN"}
    process = start_root(
        port,
        *("--decode-workers", "2", "--grace-period", "0", "--served-model-name", "foo"),
        *("--control-api-port", str(api_port)),
        env=env,
    )
    try:
        anyio.run(wait_healthy, port, 60)
        socket = user_run_dir() / f"root-{process.pid}" / "control.sock"
        anyio.run(partial(wait_until, socket.exists, timeout=30))
        yield port, api_port
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        assert process.stdout is not None
        process.stdout.close()


def test_the_control_commands_operate_a_running_root(root: tuple[int, int]) -> None:
    port, api_port = root
    models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["foo"]

    table = _cli("workers")
    assert table.exit_code == 0, table.output
    assert [line.split()[:2] for line in table.stdout.splitlines()[1:]] == [
        ["decode-0", "serving"],
        ["decode-1", "serving"],
    ]
    assert {w: s["state"] for w, s in _states().items()} == {
        "decode-0": "serving",
        "decode-1": "serving",
    }

    drained = _cli("drain", "decode-0")
    assert (drained.exit_code, drained.stdout) == (0, "drained decode-0\n"), drained.output
    assert _states()["decode-0"] == {
        "state": "unregistered",
        "role": "aggregated",
        "released": [],
        "routable": False,
    }
    undrained = _cli("undrain", "decode-0", "--json")
    assert undrained.exit_code == 0, undrained.output
    assert json.loads(undrained.stdout) == {"status": "ok"}
    assert _states()["decode-0"]["state"] == "serving"

    released = _cli("release", "decode-1", "--tag", "weights", "--tag", "kv_cache")
    assert released.exit_code == 0, released.output
    state = _states()["decode-1"]
    assert (state["state"], state["released"], state["routable"]) == (
        "released",
        ["kv_cache", "weights"],
        False,
    )
    resumed = _cli("resume", "decode-1")
    assert resumed.exit_code == 0, resumed.output
    assert _states()["decode-1"]["state"] == "serving"

    ghost = _cli("drain", "ghost")
    assert ghost.exit_code == 1
    assert "refused (409): unknown or not running worker 'ghost'" in " ".join(ghost.output.split())
    both = _cli("release", "decode-0", "--pool", "decode")
    assert both.exit_code == 2
    assert "a WORKER or a --pool" in both.output

    # Another host's operator: the API's URL and a token of their own, here a wrong one.
    url = f"http://127.0.0.1:{api_port}"
    wrong = _cli(
        "workers", env={"ACTORSERVE_CONTROL_API_URL": url, "ACTORSERVE_CONTROL_TOKEN": "x"}
    )
    assert wrong.exit_code == 1
    assert "refused (403): wrong token" in wrong.output


def test_no_running_root_is_a_clear_error() -> None:
    result = _cli("workers")
    assert result.exit_code == 1
    assert "no running root of this user" in result.output


def test_scale_grows_and_shrinks_a_running_roots_pool(root: tuple[int, int]) -> None:
    port, _ = root
    up = _cli("scale", "decode", "--by", "1")
    assert (up.exit_code, up.stdout) == (0, "the decode pool has 3 workers (added decode-2)\n"), (
        up.output
    )
    assert _states()["decode-2"]["state"] == "serving"
    # The new worker is a node of the live tree, under its pool.
    shown = _cli("tree", "--json")
    assert shown.exit_code == 0, shown.output
    pools = [c for c in json.loads(shown.stdout)["children"] if c["id"] == "model:foo"]
    decode = next(c for c in pools[0]["children"] if c["id"] == "decode-pool")
    assert [c["id"] for c in decode["children"]] == ["decode-0", "decode-1", "decode-2"]
    completion = {"model": "foo", "prompt": "after the scale", "max_tokens": 4}
    assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=completion).is_success

    down = _cli("scale", "decode", "--by", "-1", "--worker", "decode-0", "--json")
    assert down.exit_code == 0, down.output
    assert json.loads(down.stdout)["result"]["workers"] == ["decode-1", "decode-2"]
    to = _cli("scale", "decode", "--to", "1")
    assert (to.exit_code, to.stdout) == (0, "the decode pool has 1 worker (removed decode-2)\n")
    assert set(_states()) == {"decode-1"}
    below = _cli("scale", "decode", "--to", "0")
    assert below.exit_code == 1
    said = " ".join(below.output.split())
    assert "refused (409): the decode pool of 'foo' has 1 worker and may not go below 1" in said
    neither = _cli("scale", "decode")
    assert neither.exit_code == 2
    assert "--by N or --to N" in neither.output
