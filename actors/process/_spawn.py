"""Starting actor processes through our forkserver, so a restart skips interpreter start-up
and the heavy imports (preloaded once)."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["exit_code", "preload", "start_process"]

_PRELOAD = ["actors.process._child", "zmq", "anyio", "msgspec", "protocols.codec"]


def preload(modules: Iterable[str]) -> None:
    """Add modules the forkserver imports once for every child it forks from then on."""
    for name in modules:
        if name not in _PRELOAD:
            _PRELOAD.append(name)


def start_process(
    endpoints: list[str], factory: str, args: bytes, options: bytes, tmpdir: str
) -> int:
    """Fork a child running ``actors.process._child.main``; its pid (blocking: run in a
    thread). ``tmpdir`` is the child's own: the server removes it if the root dies first."""
    from actors.process._forkserver import forkserver

    return forkserver(_PRELOAD).spawn([endpoints, factory, args, options], _PRELOAD, tmpdir)


def exit_code(pid: int) -> int | None:
    """The exit status of an exited child (blocking briefly: run in a thread)."""
    from actors.process._forkserver import forkserver

    return forkserver(_PRELOAD).exit_code(pid)
