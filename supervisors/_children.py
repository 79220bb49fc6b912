"""The supervisor's record of one child."""

from __future__ import annotations

from collections import deque
from typing import Any, Literal

import attrs

from actors import ActorRef, ExitReason
from actors.lowlevel import CellState, Incarnation
from supervisors._api import ChildInfo
from supervisors._spec import ChildSpec, Restart

__all__ = ["Child"]


@attrs.define(eq=False)
class Child:
    id: str
    spec: ChildSpec
    ref: ActorRef[Any]
    args: tuple[Any, ...] = ()
    inc: Incarnation | None = None
    terminating: bool = False
    started_at: float = 0.0
    restart_attempts: int = 0  # consecutive, for backoff
    pending_restart: int = 0  # token of a scheduled delayed restart (0: none)
    # Restart times within the quarantine period, and how many quarantines in a row.
    recent_restarts: deque[float] = attrs.Factory(deque)
    quarantines: int = 0
    quarantined: bool = False

    @property
    def label(self) -> str:
        """The metric label: the spec id (dynamic children share their template's)."""
        return self.spec.id

    def wants_restart(self, reason: ExitReason) -> bool:
        restart = self.spec.restart
        if restart is Restart.PERMANENT:
            return True
        if restart is Restart.TRANSIENT:
            return reason.is_abnormal
        return False

    def info(self) -> ChildInfo:
        state: Literal["running", "restarting", "quarantined", "undefined"]
        if self.inc is not None:
            state = "running"
        elif self.quarantined:
            state = "quarantined"
        elif self.ref._cell.state is CellState.RESTARTING:
            state = "restarting"
        else:
            state = "undefined"
        return ChildInfo(self.id, self.ref, state, self.spec.kind)
