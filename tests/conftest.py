"""Suite-wide fixtures: every async test runs on asyncio and on trio, and after every test no
task, child process or socket may be left behind."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psutil
import pytest
import sniffio
import structlog

# Keep the suite's output readable: supervisors log every child start at debug.
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

pytest_plugins = ["tests.helpers.fixtures"]


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _live_tasks() -> set[Any]:
    if sniffio.current_async_library() == "trio":
        import trio

        found: set[Any] = set()
        stack = [trio.lowlevel.current_root_task()]
        while stack:
            task = stack.pop()
            found.add(task)
            for nursery in task.child_nurseries:
                stack.extend(nursery.child_tasks)
        return found
    import asyncio

    # anyio's pytest runner keeps one task alive across tests: it is not ours.
    return {
        t
        for t in asyncio.all_tasks()
        if not t.done() and "_call_in_runner_task" not in repr(t.get_coro())
    }


@pytest.fixture
async def _no_leaked_tasks() -> AsyncIterator[None]:
    import anyio

    before = _live_tasks()
    yield
    # Give tasks that are already finishing one scheduling round to go.
    deadline = time.monotonic() + 1.0
    while True:
        leaked = _live_tasks() - before
        current = anyio.get_current_task()
        leaked = {t for t in leaked if id(t) != current.id and _task_name(t) != current.name}
        if not leaked or time.monotonic() > deadline:
            break
        await anyio.sleep(0.01)
    assert not leaked, f"leaked tasks: {sorted(_task_name(t) for t in leaked)}"


def _task_name(task: Any) -> str:
    name = getattr(task, "name", None)
    if name is None and hasattr(task, "get_name"):
        name = task.get_name()
    return str(name)


def _socket_fds() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out.add(f"{fd}:{target}")
    return out


@pytest.fixture(autouse=True)
def _no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test: no child process and no socket left open (plus no task, for async
    tests)."""
    if "anyio_backend" in request.fixturenames:
        request.getfixturevalue("_no_leaked_tasks")
    me = psutil.Process()
    sockets_before = _socket_fds()
    yield
    deadline = time.monotonic() + 5.0
    while True:
        children = [c for c in me.children(recursive=True) if _counts_as_leak(c)]
        new_sockets = _socket_fds() - sockets_before
        if (not children and not new_sockets) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert not children, f"leaked child processes: {[(c.pid, _cmd(c)) for c in children]}"
    assert not new_sockets, f"leaked sockets: {sorted(new_sockets)}"


def _counts_as_leak(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE and not _is_shared_server(proc)
    except psutil.NoSuchProcess:
        return False


def _is_shared_server(proc: psutil.Process) -> bool:
    # The process actors' forkserver lives for the whole session by design (it makes restarts
    # cheap); what it forks must still be gone.
    return "actors.process._forkserver" in _cmd(proc)


def _cmd(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return "?"
