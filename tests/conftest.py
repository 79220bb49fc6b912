"""Suite-wide fixtures: every async test runs on asyncio and on trio, and after every test no
task, child process, socket or temporary file may be left behind."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator

import psutil
import pytest
import structlog

from scenarios._leaks import live_tasks, socket_fds, task_name
from tests.helpers.processes import command_line, leaked_children
from tests.helpers.timetrap import _timetrap

# Keep the suite's output readable: supervisors log every child start at debug.
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

pytest_plugins = ["tests.helpers.fixtures"]

# A temporary directory for this run alone (child processes inherit it): whatever appears in it
# during a test and stays after it is a leak (a socket file of a killed process, say).
# pytest-xdist's workers inherit the controller's TMPDIR: each makes its directory beside the
# controller's, not inside it, where ipc:// socket paths would pass their 107-character limit.
_TMP = tempfile.mkdtemp(
    prefix="actorserve-tests-",
    dir=os.environ.setdefault("ACTORSERVE_TESTS_TMPROOT", tempfile.gettempdir()),
)
os.environ["TMPDIR"] = tempfile.tempdir = _TMP
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)
# The roots' private run directories (control socket, token) live here too: a root's directory
# left behind after its test is a leak like any other file.
os.environ["XDG_RUNTIME_DIR"] = _TMP
_RUN = os.path.join(_TMP, "actorserve")
os.mkdir(_RUN, 0o700)


def _temp_files() -> set[str]:
    names = {name for name in os.listdir(_TMP) if not name.startswith("pytest-of-")}
    return names | {f"actorserve/{name}" for name in os.listdir(_RUN)}


# The GPU suite runs only where tests/gpu/run.sh names its model (a GPU host): CI has no GPU.
collect_ignore = [] if os.environ.get("ACTORSERVE_GPU_MODEL") else ["gpu"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Slow tests first: handed out at the start, they run beside the many short ones on the
    # other xdist worker instead of becoming the tail of the run.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


# Every test has a watchdog: a hang fails its test instead of stalling the whole run.
__all__ = ["_timetrap"]


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def _no_leaked_tasks() -> AsyncIterator[None]:
    import anyio

    before = live_tasks()
    yield
    # Give tasks that are already finishing one scheduling round to go.
    deadline = time.monotonic() + 1.0
    while True:
        leaked = live_tasks() - before
        current = anyio.get_current_task()
        leaked = {t for t in leaked if id(t) != current.id and task_name(t) != current.name}
        if not leaked or time.monotonic() > deadline:
            break
        await anyio.sleep(0.01)
    assert not leaked, f"leaked tasks: {sorted(task_name(t) for t in leaked)}"


@pytest.fixture(autouse=True)
def _logging_restored() -> Iterator[None]:
    """A command run in-process (typer's CliRunner) configures logging for the whole process:
    put structlog, the root logger and telemetry's record back, else a later test's
    ``capture_logs`` misses what that level now filters out."""
    import actors.telemetry as telemetry

    config = structlog.get_config()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    recorded = telemetry._settings, telemetry._handler
    yield
    structlog.configure(**config)
    root.handlers[:] = handlers
    root.setLevel(level)
    telemetry._settings, telemetry._handler = recorded


@pytest.fixture(autouse=True)
def _no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test: no child process and no socket left open (plus no task, for async
    tests)."""
    if "anyio_backend" in request.fixturenames:
        request.getfixturevalue("_no_leaked_tasks")
    me = psutil.Process()
    sockets_before = socket_fds()
    files_before = _temp_files()
    yield
    deadline = time.monotonic() + 5.0
    while True:
        children = leaked_children(me)
        new_sockets = socket_fds() - sockets_before
        new_files = _temp_files() - files_before
        if (not children and not new_sockets and not new_files) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert not children, f"leaked child processes: {[(c.pid, command_line(c)) for c in children]}"
    assert not new_sockets, f"leaked sockets: {sorted(new_sockets)}"
    assert not new_files, f"leaked temporary files: {sorted(new_files)}"
