"""The root's staged graceful shutdown, its hard deadline, and what a second signal does.

unregister (``/health`` says notready) -> grace period (still serving) -> stop admission (new
requests get 503) -> drain in-flight requests (within budget; what is left ends with a typed
``EngineShutdown``) -> wait for KV transfers prefill workers still owe -> the caller stops the
tree (engine cleanup) -> exit 0. An OS thread enforces the hard deadline even if the event loop
is stuck; a second signal exits at once.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import TYPE_CHECKING

import anyio
import structlog

from actors import ActorError
from actors.serving.root._lifecycle import Budgets
from actors.serving.root._rundir import remove_on_hard_exit
from actors.serving.root._stages import Stage, wait_quiescent
from protocols import control

if TYPE_CHECKING:
    from actors.serving.root._tree import Serving

__all__ = ["EXIT_HARD_DEADLINE", "EXIT_SECOND_SIGNAL", "Watchdog", "shutdown_serving"]

EXIT_SECOND_SIGNAL = 70  # as Dynamo's worker does
EXIT_HARD_DEADLINE = 71

_log = structlog.get_logger("actorserve.shutdown")


class Watchdog:
    """Kills the process with :data:`EXIT_HARD_DEADLINE` if shutdown outlives ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self.seconds = seconds

    def _expire(self) -> None:
        sys.stderr.write(
            f"actorserve: shutdown exceeded its {self.seconds:g} s deadline; exiting\n"
        )
        sys.stderr.flush()
        remove_on_hard_exit()
        os._exit(EXIT_HARD_DEADLINE)

    def start(self) -> None:
        self._timer.start()

    def cancel(self) -> None:
        self._timer.cancel()


def hard_deadline(budgets: Budgets) -> float:
    """All stage budgets plus a margin (for the handover past the drain budget)."""
    return budgets.grace + budgets.drain + budgets.transfers + budgets.cleanup + 5.0


async def shutdown_serving(serving: Serving, budgets: Budgets) -> None:
    """Run every stage before the tree itself is stopped."""
    admission = serving.admission
    with Stage("shutdown", "unregister"):
        admission.ready = False
    with Stage("shutdown", "grace"):
        await anyio.sleep(budgets.grace)
    with Stage("shutdown", "stop_admission"):
        admission.admitting = False
    with Stage("shutdown", "drain", inflight=admission.inflight):
        with anyio.move_on_after(budgets.drain):
            await admission.wait_idle()
        if admission.inflight:
            _log.warning("drain budget exceeded", inflight=admission.inflight)
            for entry in serving.workers():
                try:
                    await entry.engine.ask(control.Drain(handover=True, shutdown=True), timeout=2.0)
                except ActorError:
                    pass
            with anyio.move_on_after(5.0):
                await admission.wait_idle()
    with Stage("shutdown", "transfers"):
        with anyio.move_on_after(budgets.transfers):
            for entry in serving.workers():
                if entry.role == "prefill":
                    try:
                        await wait_quiescent(entry.engine)
                    except ActorError:
                        pass
