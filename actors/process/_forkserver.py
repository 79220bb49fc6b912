"""Our forkserver: a process that imports the heavy modules once and forks actor processes.

multiprocessing's forkserver re-runs the parent's ``__main__`` in every child and moves its
arguments with pickle; this one runs only :func:`actors.process._child.main`, with msgpack
commands on a pipe.

Orphans are impossible by construction: the server exits (killing its children and removing
their temporary directories) when its stdin closes, which happens when the root dies however it
dies, and every child carries ``PR_SET_PDEATHSIG=SIGKILL`` against the server.
"""

from __future__ import annotations

import atexit
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import threading
from typing import IO, Any

import msgspec

__all__ = ["ForkServer", "forkserver"]

_LEN = struct.Struct(">I")


def _write(stream: IO[bytes], obj: Any) -> None:
    data = msgspec.msgpack.encode(obj)
    stream.write(_LEN.pack(len(data)) + data)
    stream.flush()


def _read_exact(fd: int, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return out


def _read(fd: int) -> Any:
    (size,) = _LEN.unpack(_read_exact(fd, 4))
    return msgspec.msgpack.decode(_read_exact(fd, size))


class ForkServer:
    """The root's handle on the forkserver process."""

    def __init__(self, preload: list[str]) -> None:
        # Started from whichever thread asks first; it does not rely on PDEATHSIG (which tracks
        # the creating thread) but on its stdin closing.
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "actors.process._forkserver", *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
            # Its own session: signals to the root's process group (Ctrl-C, a shell's kill of the
            # job) reach the root only, which stops its actor processes in order.
            start_new_session=True,
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._in = self._proc.stdin
        self._out_fd = self._proc.stdout.fileno()
        self._lock = threading.Lock()
        self._exit_codes: dict[int, int] = {}

    @property
    def pid(self) -> int:
        return self._proc.pid

    def spawn(self, args: list[Any], preload: list[str], tmpdir: str) -> int:
        """Fork a child running ``_child.main(*args)``, once the server has imported
        ``preload``; its pid (blocking: run in a thread). The server removes ``tmpdir`` when it
        kills the child because the root is gone."""
        with self._lock:
            _write(self._in, ["spawn", args, preload, tmpdir])
            while True:
                event = _read(self._out_fd)
                if event[0] == "pid":
                    return int(event[1])
                self._exit_codes[int(event[1])] = int(event[2])

    def exit_code(self, pid: int) -> int | None:
        """The exit status of a child that has exited (blocking briefly: run in a thread).

        Negative: killed by that signal, as ``subprocess`` reports it.
        """
        with self._lock:
            _write(self._in, ["status", pid])
            while True:
                event = _read(self._out_fd)
                if event[0] == "status":
                    code = event[2]
                    return None if code is None else int(code)
                self._exit_codes[int(event[1])] = int(event[2])

    def close(self) -> None:
        """Stop the server; it kills any child still running."""
        if not self._in.closed:
            self._in.close()
        self._proc.wait(5)
        if self._proc.stdout is not None:
            self._proc.stdout.close()


_server: ForkServer | None = None
_server_lock = threading.Lock()


def forkserver(preload: list[str]) -> ForkServer:
    """The process-wide forkserver, started on first use."""
    global _server
    with _server_lock:
        if _server is None or _server._proc.poll() is not None:
            _server = ForkServer(preload)
            atexit.register(_server.close)
        return _server


# -- the server process --------------------------------------------------------------------


def _serve() -> None:
    import importlib

    # Ctrl-C reaches the whole process group: the root decides how its actors stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def preload(names: list[str]) -> None:
        for name in names:
            if name not in sys.modules:
                try:
                    importlib.import_module(name)
                except ImportError:
                    pass  # the child imports it again and reports why

    preload(sys.argv[1:])
    from actors.process._child import main as child_main

    commands = sys.stdin.buffer.fileno()
    out = sys.stdout.buffer
    children: dict[int, int | None] = {}
    tmpdirs: list[str] = []  # the root removes each once its child is gone, unless it died
    while True:
        ready, _, _ = select.select([commands], [], [], 0.05)
        children.update(_reap(children))
        if not ready:
            continue
        try:
            command = _read(commands)
        except EOFError:
            break
        if command[0] == "spawn":
            preload(command[2])  # modules added after the server started
            pid = os.fork()
            if pid == 0:
                os.close(commands)
                os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                code = 0
                try:
                    child_main(*command[1])
                except BaseException:
                    import traceback

                    traceback.print_exc()
                    code = 1
                finally:
                    os._exit(code)
            children[pid] = None
            tmpdirs.append(command[3])
            _write(out, ["pid", pid])
        elif command[0] == "status":
            pid = int(command[1])
            for _ in range(100):  # the pidfd fired: the status follows within milliseconds
                children.update(_reap(children))
                if children.get(pid) is not None or pid not in children:
                    break
                select.select([], [], [], 0.002)
            _write(out, ["status", pid, children.pop(pid, None)])
    for pid, status in children.items():
        if status is None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for path in tmpdirs:
        shutil.rmtree(path, ignore_errors=True)


def _reap(children: dict[int, int | None]) -> list[tuple[int, int]]:
    done = []
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        done.append(
            (pid, -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
        )
    return done


if __name__ == "__main__":
    _serve()
