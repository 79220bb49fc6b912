"""What a run must not leave behind: tasks, child processes, sockets (KV blocks are checked on
the engines themselves, before the tree stops)."""

from __future__ import annotations

import os
from typing import Any

import anyio
import attrs
import psutil
import sniffio

__all__ = ["Snapshot", "leaks_since", "live_tasks", "socket_fds", "task_name"]


def live_tasks() -> set[Any]:
    if sniffio.current_async_library() == "trio":
        import trio

        found: set[Any] = set()
        root = trio.lowlevel.current_root_task()
        stack = [root] if root is not None else []
        while stack:
            task = stack.pop()
            found.add(task)
            for nursery in task.child_nurseries:
                stack.extend(nursery.child_tasks)
        return found
    import asyncio

    # anyio's pytest runner keeps one task alive across tests: it is nobody's leak.
    return {
        t
        for t in asyncio.all_tasks()
        if not t.done() and "_call_in_runner_task" not in repr(t.get_coro())
    }


def task_name(task: Any) -> str:
    name = getattr(task, "name", None)
    if name is None and hasattr(task, "get_name"):
        name = task.get_name()
    return str(name)


def socket_fds() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out.add(f"{fd}:{target}")
    return out


def _children() -> dict[int, str]:
    out = {}
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(child.cmdline())
        except psutil.Error:
            continue
        # The process actors' forkserver lives as long as this process, by design (it makes
        # restarts cheap); what it forks must be gone.
        if "actors.process._forkserver" not in cmd:
            out[child.pid] = cmd
    return out


@attrs.frozen
class Snapshot:
    """What existed before the run."""

    tasks: frozenset[Any]
    sockets: frozenset[str]
    children: frozenset[int]

    @classmethod
    def take(cls) -> Snapshot:
        return cls(frozenset(live_tasks()), frozenset(socket_fds()), frozenset(_children()))


async def leaks_since(before: Snapshot, wait_s: float = 15.0) -> list[str]:
    """What the run left behind, after giving stragglers up to ``wait_s`` to go (generous: on
    a loaded machine engine processes take seconds to exit; a clean run returns at once)."""
    me = anyio.get_current_task()
    leaks: list[str] = []
    with anyio.move_on_after(wait_s):
        while True:
            tasks = {
                task_name(t)
                for t in live_tasks() - before.tasks
                if id(t) != me.id and task_name(t) != me.name
            }
            children = {p: c for p, c in _children().items() if p not in before.children}
            sockets = socket_fds() - before.sockets
            leaks = [f"task {name!r}" for name in sorted(tasks)]
            leaks += [f"process {pid} ({cmd[:60]})" for pid, cmd in children.items()]
            leaks += [f"socket {s}" for s in sorted(sockets)]
            if not leaks:
                return []
            await anyio.sleep(0.05)
    return leaks
