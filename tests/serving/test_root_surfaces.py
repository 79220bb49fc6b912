"""The root's local surfaces, probed as another user or a careless operator would: the private run
directory, the control token file, the control socket, the control API's address and its bearer
scheme."""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from structlog.testing import capture_logs

from actors import Actor
from actors.lowlevel import free_port
from actors.serving.root import (
    ControlServer,
    RootOptions,
    RunDir,
    RunDirError,
    ServeConfig,
    Serving,
    WorkerStates,
    control_app,
    serving_children,
    wait_healthy,
)
from actors.serving.root._rundir import user_run_dir, write_secret
from actors.testing import wait_until
from supervisors import ChildSpec, open_supervisor
from tests.helpers.serving import start_root


@pytest.fixture
def run_base(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    # A short base: a Unix socket's path must fit in 107 bytes.
    base = Path(tempfile.mkdtemp(prefix="run"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    yield base / "actorserve"
    shutil.rmtree(base)


def test_the_run_directory_is_private_and_made_so(run_base: Path) -> None:
    rundir = RunDir()
    try:
        assert stat.S_IMODE(os.lstat(run_base).st_mode) == 0o700
        assert stat.S_IMODE(os.lstat(rundir.path).st_mode) == 0o700
        assert rundir.path.parent == run_base
    finally:
        rundir.remove()
    assert not rundir.path.exists()


def test_a_planted_symlink_is_refused_not_followed(run_base: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    run_base.symlink_to(elsewhere)
    with pytest.raises(RunDirError, match="symlink"):
        RunDir()
    assert list(elsewhere.iterdir()) == []


def test_a_directory_open_to_others_is_refused(run_base: Path) -> None:
    run_base.mkdir()
    run_base.chmod(0o777)
    with pytest.raises(RunDirError, match="open to other users"):
        RunDir()


def test_another_users_directory_is_refused(run_base: Path) -> None:
    # The suite runs as root (CI does), which can hand a directory to another user.
    run_base.mkdir(mode=0o700)
    os.chown(run_base, 65534, 65534)
    with pytest.raises(RunDirError, match="belongs to uid 65534"):
        RunDir()


def test_a_secret_never_overwrites_a_file_or_follows_a_link(tmp_path: Path) -> None:
    planted = tmp_path / "planted"
    planted.write_text("someone else's\n")
    with pytest.raises(FileExistsError):
        write_secret(planted, "token\n")
    link = tmp_path / "link"
    victim = tmp_path / "victim"
    victim.write_text("untouched\n")
    victim.chmod(0o644)
    link.symlink_to(victim)
    with pytest.raises(FileExistsError):
        write_secret(link, "token\n")
    assert victim.read_text() == "untouched\n"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644
    fresh = tmp_path / "fresh"
    write_secret(fresh, "token\n")
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o600


def test_the_control_api_stays_on_loopback_whatever_the_frontend_host() -> None:
    serving = Serving(ServeConfig(backend="mock", host="192.0.2.1"))  # never bound here
    children = serving_children(serving, RootOptions(control_api_port=1), lambda: None)
    api = next(c for c in children if c.id == "control-api").start()
    assert api.host == "127.0.0.1"
    options = RootOptions(control_api_port=1, control_api_host="::1")
    api = next(c for c in serving_children(serving, options, lambda: None) if c.id == "control-api")
    assert api.start().host == "::1"


class _Lifecycle(Actor):
    async def receive(self, message: Any) -> Any:
        if isinstance(message, WorkerStates):
            return {"decode-0": "serving"}
        return await super().receive(message)


async def test_the_bearer_scheme_is_case_insensitive() -> None:
    async with open_supervisor([ChildSpec("lifecycle", _Lifecycle)]) as sup:
        lifecycle = await sup.child("lifecycle")
        app = control_app(lifecycle, "s3cret", lambda: None)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://control") as client:
            for scheme in ("Bearer", "bearer", "BEARER"):
                got = await client.get(
                    "/control/workers", headers={"authorization": f"{scheme} s3cret"}
                )
                assert got.status_code == 200, (scheme, got.text)
            got = await client.get("/control/workers", headers={"authorization": "Basic s3cret"})
            assert got.status_code == 401


def _start_root(port: int, env: dict[str, str]) -> subprocess.Popen[str]:
    api = ["--control-api-port", str(free_port())]
    return start_root(port, "--decode-workers", "1", "--grace-period", "0", *api, env=env)


def _listening(path: Path) -> bool:
    return path.exists() and stat.S_IMODE(os.lstat(path).st_mode) == 0o600


def _tree(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "actors.serving", "tree", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


async def test_each_root_has_its_own_private_socket_and_token_removed_however_it_ends(
    run_base: Path,
) -> None:
    env = {**os.environ, "XDG_RUNTIME_DIR": str(run_base.parent)}
    env.pop("ACTORSERVE_CONTROL_TOKEN", None)
    old_umask = os.umask(0)  # the roots inherit it: their files must be private regardless
    ports = [free_port(), free_port()]
    try:
        roots = [_start_root(port, env) for port in ports]
    finally:
        os.umask(old_umask)
    try:
        for port in ports:
            await wait_healthy(port, 60)
        dirs = [run_base / f"root-{root.pid}" for root in roots]
        # The control socket opens once the tree is up, not necessarily before /health says so,
        # and is made 0600 right after its bind (the 0700 directory guards that instant).
        await wait_until(lambda: all(_listening(d / "control.sock") for d in dirs), timeout=30)
        for rundir in dirs:
            assert stat.S_IMODE(os.lstat(rundir).st_mode) == 0o700
            assert stat.S_IMODE(os.lstat(rundir / "control.sock").st_mode) == 0o600
            assert stat.S_IMODE(os.lstat(rundir / "control.token").st_mode) == 0o600
        tokens = {(d / "control.token").read_text() for d in dirs}
        assert len(tokens) == 2  # one token per root

        both = await anyio.to_thread.run_sync(_tree, env)
        assert both.returncode == 1
        assert "several roots are running" in both.stdout + both.stderr

        roots[0].kill()  # SIGKILL: nothing of the root runs again
        await anyio.to_thread.run_sync(roots[0].wait, 30)
        assert dirs[0].exists()
        one = await anyio.to_thread.run_sync(_tree, env)  # finds the live one, drops the stale
        assert one.returncode == 0, one.stdout + one.stderr
        assert '"id": "root"' in one.stdout
        assert not dirs[0].exists()

        roots[1].send_signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(roots[1].wait, 60) == 0
        assert not dirs[1].exists()
        await wait_until(lambda: list(run_base.iterdir()) == [], timeout=5)
    finally:
        for root in roots:
            if root.poll() is None:
                root.kill()
                root.wait()
            assert root.stdout is not None
            root.stdout.close()


def test_user_run_dir_is_reused(run_base: Path) -> None:
    assert user_run_dir() == user_run_dir() == run_base


class _Idle(Actor):
    pass


async def test_the_control_socket_outlives_running_out_of_descriptors(run_base: Path) -> None:
    rundir = RunDir()
    path = str(rundir.control_socket)
    command = [sys.executable, "-m", "actors.serving", "tree", "--json", "--control", path]
    try:
        async with open_supervisor([ChildSpec("idle", _Idle)]) as sup:
            await sup.start_child(ChildSpec("control", lambda: ControlServer(sup, path)))
            await wait_until(lambda: os.path.exists(path))
            client = await anyio.open_process(command, stderr=subprocess.STDOUT)
            async with client:
                soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
                hog: list[int] = []
                with capture_logs() as logs:
                    try:
                        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 4096), hard))
                        with contextlib.suppress(OSError):
                            while True:
                                hog.append(os.open(os.devnull, os.O_RDONLY))
                        # The client connects while this process has no descriptor left.
                        await wait_until(
                            lambda: any("out of descriptors" in e["event"] for e in logs),
                            timeout=60,
                        )
                    finally:
                        for fd in hog:
                            os.close(fd)
                        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
                assert client.stdout is not None
                out = b"".join([chunk async for chunk in client.stdout]).decode()
                assert await client.wait() == 0, out
            assert '"id": "idle"' in out
    finally:
        rundir.remove()
