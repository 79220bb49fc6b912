"""Running a supervision tree inside your own program: :func:`open_supervisor`."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import anyio

from actors import ActorRef, Clock, ExitReason, Registry
from actors.lowlevel import Cell, CellState, Incarnation, reset_registry, set_registry, unwrap_error
from supervisors._api import SupervisorRef
from supervisors._errors import SupervisorExited
from supervisors._spec import ChildSpec, SupervisorFlags
from supervisors._supervisor import Supervisor

__all__ = ["open_supervisor"]


@asynccontextmanager
async def open_supervisor(
    children: Sequence[ChildSpec] = (),
    flags: SupervisorFlags | None = None,
    *,
    name: str = "root",
    clock: Clock | None = None,
    registry: Registry | None = None,
    shutdown_timeout: float | None = None,
) -> AsyncIterator[SupervisorRef]:
    """Start a root supervisor in the current task, yield its ref, stop it on exit.

    Start-up is synchronous, as OTP's ``start_link``: every child is ready (or the block raises
    :class:`ChildStartFailed`) before the body runs. Leaving the block stops the tree in reverse
    start order; ``shutdown_timeout`` bounds that before everything left is cancelled. If the root
    exits by itself (restart intensity reached, auto_shutdown), the body is cancelled and
    :class:`SupervisorExited` raised. Named children are registered in ``registry`` (a fresh one
    by default), which every task of the tree sees as :func:`actors.current_registry`.
    """
    token = set_registry(registry if registry is not None else Registry())  # (empty is falsy)
    supervisor = Supervisor(children, flags, name=name, clock=clock)
    ref: ActorRef[Supervisor] = ActorRef(Cell(name))
    inc = Incarnation(supervisor, ref)
    exited_by_itself: ExitReason | None = None

    def on_exit(reason: ExitReason) -> CellState:
        nonlocal exited_by_itself
        if not stopping:
            exited_by_itself = reason
            tg.cancel_scope.cancel()
        return CellState.DEAD

    stopping = False
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(inc.run, ref._cell, on_exit, name=f"supervisor {name}")
            await inc.ready.wait(None)
            try:
                yield SupervisorRef(ref)
            except Exception as exc:
                if exited_by_itself is None:
                    raise
                # The body's calls failed because the root exited by itself: that is the news.
                raise SupervisorExited(name, exited_by_itself) from exc
            finally:
                stopping = True
                inc.request_stop(ExitReason.shutdown())
                with anyio.CancelScope(shield=True):
                    with anyio.move_on_after(
                        math.inf if shutdown_timeout is None else shutdown_timeout
                    ):
                        await inc.finished.wait()
                    inc.kill(ExitReason.killed("shutdown timeout"))
                    await inc.finished.wait()
    except BaseExceptionGroup as group:
        # anyio wraps even a single error (a start failure, the body's own exception): give it
        # back as raised.
        error = unwrap_error(group)
        if error is group:
            raise
        raise error from None
    finally:
        reset_registry(token)
    if exited_by_itself is not None:
        raise SupervisorExited(name, exited_by_itself)
