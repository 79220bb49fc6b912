"""Which child processes a test (or a module of tests) left behind."""

from __future__ import annotations

import psutil

__all__ = ["command_line", "leaked_children"]


def leaked_children(proc: psutil.Process) -> list[psutil.Process]:
    """``proc``'s live descendants, zombies and the shared forkserver aside."""
    return [c for c in proc.children(recursive=True) if _counts_as_leak(c)]


def command_line(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return "?"


def _counts_as_leak(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE and not _is_shared_server(proc)
    except psutil.NoSuchProcess:
        return False


def _is_shared_server(proc: psutil.Process) -> bool:
    # The process actors' forkserver lives for the whole session by design (it makes restarts
    # cheap); what it forks must still be gone.
    return "actors.process._forkserver" in command_line(proc)
