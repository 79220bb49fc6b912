"""A root of its own: ``actorserve run`` in a child process, for faults aimed at the root itself
(a SIGTERM must reach a real process, with its signal handling, exit code and clean-up)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.abc
import attrs
import psutil
import yaml
from anyio.streams.text import TextReceiveStream

from actors.serving import ServeConfig

__all__ = ["RootProcess", "open_root_process"]

_READY = re.compile(r"ready\S*: (http://[0-9.]+:\d+)/v1")
# The root's staged shutdown budgets (``actorserve run`` options), scaled to CI.
GRACE_S = 0.2
DRAIN_S = 10.0


@attrs.define
class RootProcess:
    """The running root: its process, URL, every process it started, its last log lines."""

    process: anyio.abc.Process
    url: str = ""
    pids: set[int] = attrs.field(factory=set)
    log: deque[str] = attrs.field(factory=lambda: deque(maxlen=40))
    exit_code: int | None = None
    exited_after_s: float | None = None  # from the signal to its exit

    def collect_pids(self) -> None:
        """Remember the root's descendants (its forkserver and engines live in another session,
        so they are looked up while the root still runs)."""
        try:
            root = psutil.Process(self.process.pid)
            self.pids |= {p.pid for p in root.children(recursive=True)}
        except psutil.Error:
            pass

    def survivors(self) -> list[str]:
        alive = []
        for pid in sorted(self.pids):
            try:
                proc = psutil.Process(pid)
                if proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"process {pid} ({' '.join(proc.cmdline())[:60]})")
            except psutil.Error:
                continue
        return alive


def _command(config_path: Path, backend: str) -> list[str]:
    return [
        sys.executable,
        "-c",
        "from actors.serving.cli import main; main()",
        "run",
        "--config",
        str(config_path),
        "--loop",
        backend,
        "--log-level",
        "error",
        "--grace-period",
        str(GRACE_S),
        "--drain-budget",
        str(DRAIN_S),
    ]


@asynccontextmanager
async def open_root_process(
    config: ServeConfig, tmp: Path, backend: str, start_timeout: float
) -> AsyncIterator[RootProcess]:
    """Start ``actorserve run`` with ``config``; yield once it serves. On exit, a root still
    running is stopped (SIGTERM, then SIGKILL)."""
    path = tmp / "serve.yaml"
    path.write_text(yaml.safe_dump(attrs.asdict(config)))
    # A wide console, so the "ready" line with the URL is never wrapped.
    env = {**os.environ, "COLUMNS": "400", "PYTHONUNBUFFERED": "1"}
    process = await anyio.open_process(
        _command(path, backend), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env
    )
    root = RootProcess(process)
    ready = anyio.Event()

    async def read_log() -> None:
        assert process.stderr is not None
        pending = ""
        async for text in TextReceiveStream(process.stderr):
            pending += text
            *lines, pending = pending.split("\n")
            for line in lines:
                root.log.append(line)
                match = _READY.search(line)
                if match and not ready.is_set():
                    root.url = match.group(1)
                    ready.set()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(read_log)
            with anyio.fail_after(start_timeout):
                while not ready.is_set():
                    if process.returncode is not None:
                        raise RuntimeError(f"the root exited at start: {_tail(root)}")
                    with anyio.move_on_after(0.1):
                        await ready.wait()
            root.collect_pids()
            yield root
            await _stop(root)
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await _stop(root)
            await process.aclose()


async def _stop(root: RootProcess) -> None:
    process = root.process
    if process.returncode is None:
        root.collect_pids()
        process.terminate()
        with anyio.move_on_after(DRAIN_S + 20):
            await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()


def _tail(root: RootProcess) -> str:
    return " | ".join(list(root.log)[-5:])
