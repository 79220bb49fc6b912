"""How a supervisor stops its children and frees their refs and names.

Termination order belongs to the caller (:class:`~supervisors._core.SupervisorCore`): one child at a
time in reverse start order, or simple_one_for_one's children all at once. These functions do
one step of it and emit the ``terminated`` event under the supervisor's name.
"""

from __future__ import annotations

from collections.abc import Iterable

import anyio

from actors import ExitReason, current_registry
from actors.lowlevel import CellState
from supervisors._children import Child
from supervisors._events import emit

__all__ = ["release", "terminate", "terminate_parallel"]


async def terminate(supervisor: str, child: Child) -> None:
    """Stop one child per its shutdown spec: graceful request, timeout, then kill."""
    inc = child.inc
    if inc is None:
        return
    child.terminating = True
    try:
        timeout = child.spec.shutdown_timeout
        if timeout <= 0:
            inc.kill(ExitReason.killed())
        else:
            inc.request_stop(ExitReason.shutdown())
            with anyio.move_on_after(timeout):
                await inc.finished.wait()
            inc.kill(ExitReason.killed("shutdown timeout"))
        await inc.finished.wait()
    finally:
        child.terminating = False
    child.inc = None
    emit(supervisor, child.label, "terminated", reason=str(inc.exit_reason))


async def terminate_parallel(supervisor: str, children: list[Child], timeout: float) -> None:
    """OTP stops simple_one_for_one children in parallel: all are asked to stop at once and
    share the template's shutdown ``timeout``, then what is left is killed (no task per child:
    there may be 100k of them)."""
    running = [(child, child.inc) for child in children if child.inc is not None]
    for child, inc in running:
        child.terminating = True
        if timeout <= 0:
            inc.kill(ExitReason.killed())
        else:
            inc.request_stop(ExitReason.shutdown())
    with anyio.move_on_after(timeout):
        for _, inc in running:
            if not inc.finished.is_set():
                await inc.finished.wait()
    for _, inc in running:
        inc.kill(ExitReason.killed("shutdown timeout"))  # a no-op for those that exited
    for child, inc in running:
        if not inc.finished.is_set():
            await inc.finished.wait()
        child.terminating = False
        child.inc = None
        emit(supervisor, child.label, "terminated", reason=str(inc.exit_reason))


def release(children: Iterable[Child]) -> None:
    """The children's refs end dead and their names are freed."""
    registry = current_registry()
    for child in children:
        if child.ref._cell.state is not CellState.RUNNING:
            child.ref._cell.set_state(CellState.DEAD)
        if child.spec.name is not None:
            registry.unregister(child.spec.name, child.ref)
