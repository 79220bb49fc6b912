"""Supervisor errors, under one root: :class:`SupervisorError`.

Those a child administration call answers with are reply errors too: the caller gets them, the
supervisor keeps running (OTP's ``{error, Reason}`` returns). The hierarchy (a class subclasses
the nearest less indented one above it)::

    SupervisorError ................... anything a supervisor raises at its user
        SupervisorReplyError .......... a call's error answer; an actors.ReplyError too
            ChildNotFound ............. no child of that id or ref
            ChildRunning .............. restart or delete of a running child
            ChildRestarting ........... restart or delete of a child waiting to restart
            ChildAlreadyPresent ....... start_child: the id is taken by a stopped child
            ChildAlreadyStarted ....... start_child: the id is taken by a running child
            ChildStartFailed .......... the child's start raised or timed out (``cause``)
            InvalidChildSpec .......... a malformed child spec; a ValueError too
            InvalidFlags .............. malformed supervisor flags; a ValueError too
        SupervisorExited .............. the root supervisor of ``open_supervisor`` exited
"""

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
    "SupervisorReplyError",
]


class SupervisorError(Exception):
    """Base of every error of the supervisors package."""


class SupervisorReplyError(SupervisorError, ReplyError):
    """A supervisor call failed: its caller gets this error, the supervisor goes on."""


class ChildNotFound(SupervisorReplyError):
    def __init__(self, child_id: object) -> None:
        super().__init__(f"no child {child_id!r}")
        self.child_id = child_id


class ChildRunning(SupervisorReplyError):
    def __init__(self, child_id: str) -> None:
        super().__init__(f"child {child_id!r} is running")
        self.child_id = child_id


class ChildRestarting(SupervisorReplyError):
    def __init__(self, child_id: str) -> None:
        super().__init__(f"child {child_id!r} is restarting")
        self.child_id = child_id


class ChildAlreadyPresent(SupervisorReplyError):
    """A spec with that id exists but is not running."""

    def __init__(self, child_id: str) -> None:
        super().__init__(f"child {child_id!r} already present")
        self.child_id = child_id


class ChildAlreadyStarted(SupervisorReplyError):
    def __init__(self, child_id: str, ref: ActorRef[Any]) -> None:
        super().__init__(f"child {child_id!r} already started")
        self.child_id = child_id
        self.ref = ref


class ChildStartFailed(SupervisorReplyError):
    """A child's start raised (or timed out); ``cause`` is why."""

    def __init__(self, child_id: object, cause: BaseException) -> None:
        super().__init__(f"child {child_id!r} failed to start: {type(cause).__name__}: {cause}")
        self.child_id = child_id
        self.cause = cause


class InvalidChildSpec(SupervisorReplyError, ValueError):
    """A child spec is malformed; ``field`` names the offending key."""

    def __init__(self, child_id: object, field: str, problem: str) -> None:
        super().__init__(f"invalid child spec {child_id!r}: {field}: {problem}")
        self.child_id = child_id
        self.field = field
        self.problem = problem


class InvalidFlags(SupervisorReplyError, ValueError):
    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"invalid supervisor flags: {field}: {problem}")
        self.field = field
        self.problem = problem


class SupervisorExited(SupervisorError):
    """The root supervisor of an :func:`open_supervisor` block exited on its own."""

    def __init__(self, name: str, reason: ExitReason) -> None:
        super().__init__(f"supervisor {name!r} exited: {reason}")
        self.name = name
        self.reason = reason
