"""Many short-lived tasks under one task of a task group: a dynamic supervisor's children.

anyio's ``start_soon`` costs many times a plain ``loop.create_task`` per task on asyncio: a handle
with its own cancel scope and event, a wrapper coroutine and a done callback per task. A
``simple_one_for_one`` supervisor starts a child per request, so on asyncio :class:`TaskHost` runs
them as plain asyncio tasks instead, owned by one host task in the supervisor's task group.
Structured all the same: when the host ends (its task group is cancelled, or the supervisor stops),
it cancels every task still running and waits for them, shielded; a task that fails (anything but a
cancellation) cancels the host, which re-raises the error in the task group, as a failed child task
of the group itself would. On trio, anyio's ``start_soon`` wraps each task in a handle too (several
times trio's own spawn), so the host opens a trio nursery and starts them there: inside the group's
cancel scopes, with trio's own semantics. Before the host runs and after it ended, tasks go to the
task group as usual.

On asyncio, tasks started here are not inside the group's cancel scopes: only the host cancels
them. What runs in them (an actor's incarnation) must therefore treat a cancellation it did not
ask for as its owner going away, which an incarnation does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import sniffio

if TYPE_CHECKING:
    import trio

__all__ = ["TaskHost"]


class TaskHost:
    """Runs tasks for ``task_group``'s owner; :meth:`run` must run as a task of that group."""

    def __init__(self, task_group: anyio.abc.TaskGroup) -> None:
        self._group = task_group
        self._loop: asyncio.AbstractEventLoop | None = None  # set while the host runs (asyncio)
        self._nursery: trio.Nursery | None = None  # set while the host runs (trio)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._scope: anyio.CancelScope | None = None
        self._error: BaseException | None = None

    def start_soon(
        self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any, name: str | None = None
    ) -> None:
        """Start ``fn(*args)`` as a task."""
        loop = self._loop
        if loop is None:
            nursery = self._nursery
            if nursery is not None:
                nursery.start_soon(fn, *args, name=name)
            else:
                self._group.start_soon(fn, *args, name=name)
            return
        task = loop.create_task(fn(*args), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None and self._error is None:
            self._error = error
            if self._scope is not None:
                self._scope.cancel()

    async def run(self) -> None:
        """Host the tasks until cancelled (or one fails: its error is raised here)."""
        if sniffio.current_async_library() == "trio":
            await self._run_trio()
            return
        try:
            with anyio.CancelScope() as self._scope:
                self._loop = asyncio.get_running_loop()
                await anyio.sleep_forever()
        finally:
            self._loop = None
            for task in self._tasks:
                task.cancel()
            with anyio.CancelScope(shield=True):
                while self._tasks:
                    await asyncio.wait(set(self._tasks))
            if self._error is not None:
                raise self._error  # also over a cancellation: the group reports it

    async def _run_trio(self) -> None:
        import trio

        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None
