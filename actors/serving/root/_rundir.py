"""Each root's private run directory: its control socket and its control token live there.

The user's directory is ``$XDG_RUNTIME_DIR/actorserve`` (or ``<tmp>/actorserve-<uid>``), mode
0700 and owned by the user, checked with ``lstat`` so that a planted symlink or another user's
directory is refused rather than followed. Each root makes ``root-<pid>`` inside it, so two roots
never share a socket, and removes it however it ends: on return, on a second signal and at the
watchdog's hard deadline (:func:`remove_on_hard_exit`); a root killed outright leaves it behind,
and the next root (or ``actorserve tree``) removes directories whose process is gone. Secrets are
created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600, never written over an existing file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from pathlib import Path

from actors.serving.errors import RunDirError

__all__ = [
    "RunDir",
    "RunDirError",
    "live_control_sockets",
    "remove_on_hard_exit",
    "token_file_of_this_root",
    "user_run_dir",
    "write_secret",
]

CONTROL_SOCKET = "control.sock"
CONTROL_TOKEN = "control.token"
_ROOT_PREFIX = "root-"
_hard_exit_dirs: list[Path] = []


def user_run_dir() -> Path:
    """This user's private directory for run state, made if missing, refused if not private."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        path = Path(runtime) / "actorserve"
    else:
        path = Path(tempfile.gettempdir()) / f"actorserve-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    _check_private(path)
    return path


def _check_private(path: Path) -> None:
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise RunDirError(f"{path} is not a directory (a symlink?): refusing to use it")
    if info.st_uid != os.getuid():
        raise RunDirError(f"{path} belongs to uid {info.st_uid}, not to us: refusing to use it")
    if info.st_mode & 0o077:
        raise RunDirError(
            f"{path} is open to other users (mode {stat.S_IMODE(info.st_mode):o}): refusing to "
            "use it; remove it or make it 0700"
        )


def write_secret(path: Path, text: str) -> None:
    """Create ``path`` with mode 0600 and ``text``; never follows a link or reuses a file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _root_dir(base: Path, pid: int) -> Path:
    return base / f"{_ROOT_PREFIX}{pid}"


def _pid_of(entry: Path) -> int | None:
    name = entry.name
    if not name.startswith(_ROOT_PREFIX):
        return None
    try:
        return int(name.removeprefix(_ROOT_PREFIX))
    except ValueError:
        return None


def _remove_stale(base: Path) -> None:
    for entry in base.iterdir():
        pid = _pid_of(entry)
        if pid is not None and pid != os.getpid() and not _alive(pid):
            shutil.rmtree(entry, ignore_errors=True)


def live_control_sockets() -> list[Path]:
    """The control sockets of this user's running roots (stale directories are removed)."""
    base = user_run_dir()
    _remove_stale(base)
    found = [entry / CONTROL_SOCKET for entry in sorted(base.iterdir()) if _pid_of(entry)]
    return [path for path in found if path.exists()]


class RunDir:
    """One root's directory: ``root-<pid>`` in :func:`user_run_dir`, removed by :meth:`remove`."""

    def __init__(self) -> None:
        base = user_run_dir()
        _remove_stale(base)
        self.path = _root_dir(base, os.getpid())
        shutil.rmtree(self.path, ignore_errors=True)  # a previous root of a reused pid
        os.mkdir(self.path, 0o700)
        _hard_exit_dirs.append(self.path)

    @property
    def control_socket(self) -> Path:
        return self.path / CONTROL_SOCKET

    def write_token(self, token: str) -> Path:
        path = self.path / CONTROL_TOKEN
        write_secret(path, token + "\n")
        return path

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(ValueError):
            _hard_exit_dirs.remove(self.path)


def token_file_of_this_root() -> Path:
    """Where this process's root wrote the control API token it made."""
    return _root_dir(user_run_dir(), os.getpid()) / CONTROL_TOKEN


def remove_on_hard_exit() -> None:
    """Remove every live root directory of this process: called right before ``os._exit``."""
    for path in _hard_exit_dirs:
        shutil.rmtree(path, ignore_errors=True)
