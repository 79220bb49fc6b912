"""Supervisor errors. Those raised by child administration calls are reply errors: the caller
gets them, the supervisor keeps running (OTP's ``{error, Reason}`` returns)."""

from __future__ import annotations

from typing import Any

from actors import ActorRef, ExitReason, ReplyError

__all__ = [
    "ChildAlreadyPresent",
    "ChildAlreadyStarted",
    "ChildNotFound",
    "ChildRestarting",
    "ChildRunning",
    "ChildStartFailed",
    "InvalidChildSpec",
    "InvalidFlags",
    "SupervisorError",
    "SupervisorExited",
]


class SupervisorError(ReplyError):
    """Base of the supervisor's typed errors."""


class ChildNotFound(SupervisorError):
    def __init__(self, child_id: object) -> None:
        super().__init__(f"no child {child_id!r}")
        self.child_id = child_id


class ChildRunning(SupervisorError):
    def __init__(self, child_id: str) -> None:
        super().__init__(f"child {child_id!r} is running")
        self.child_id = child_id


class ChildRestarting(SupervisorError):
    def __init__(self, child_id: str) -> None:
        super().__init__(f"child {child_id!r} is restarting")
        self.child_id = child_id


class ChildAlreadyPresent(SupervisorError):
    """A spec with that id exists but is not running."""

    def __init__(self, child_id: str) -> None:
        super().__init__(f"child {child_id!r} already present")
        self.child_id = child_id


class ChildAlreadyStarted(SupervisorError):
    def __init__(self, child_id: str, ref: ActorRef[Any]) -> None:
        super().__init__(f"child {child_id!r} already started")
        self.child_id = child_id
        self.ref = ref


class ChildStartFailed(SupervisorError):
    """A child's start raised (or timed out); ``cause`` is why."""

    def __init__(self, child_id: object, cause: BaseException) -> None:
        super().__init__(f"child {child_id!r} failed to start: {type(cause).__name__}: {cause}")
        self.child_id = child_id
        self.cause = cause


class InvalidChildSpec(SupervisorError, ValueError):
    """A child spec is malformed; ``field`` names the offending key."""

    def __init__(self, child_id: object, field: str, problem: str) -> None:
        super().__init__(f"invalid child spec {child_id!r}: {field}: {problem}")
        self.child_id = child_id
        self.field = field
        self.problem = problem


class InvalidFlags(SupervisorError, ValueError):
    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"invalid supervisor flags: {field}: {problem}")
        self.field = field
        self.problem = problem


class SupervisorExited(Exception):
    """The root supervisor of an :func:`open_supervisor` block exited on its own."""

    def __init__(self, name: str, reason: ExitReason) -> None:
        super().__init__(f"supervisor {name!r} exited: {reason}")
        self.name = name
        self.reason = reason
