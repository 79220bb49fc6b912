"""The actor runtime's typed errors: one root, :class:`ActorError`, for what it raises at a caller.

The hierarchy (a class subclasses the nearest less indented one above it); ``actors`` exports
every class but :class:`LinkBroken` and :class:`ProcessDied`, which ``actors.process`` does::

    ActorError ....................... what the runtime raises at a caller
        ActorNotRunning .............. never started, stopped, or dead and not restarting
            ActorRestarting .......... waiting for its supervisor to restart it
        ActorCrashed ................. died while the call was pending or handled
        AskTimeout ................... no reply in time; a TimeoutError too
        MailboxFull .................. ``tell_nowait`` found no room
        StreamCancelled .............. the consumer closed a reply stream
        UnhandledMessage ............. no handler for a message (crashes the actor)
        NameTaken .................... the name is another actor's; a KeyError too
        LinkBroken ................... its link to a process actor broke; a ConnectionError too
        ProcessDied .................. a process actor's OS process ended

Not errors of the runtime but the protocol between a handler and its caller, a branch of its own
(an ``except ActorError`` must not catch them)::

    ReplyError ....................... a handler's answer: the caller gets it, the actor goes on
    Ignore ........................... ``started()`` asks to start as OTP's ``ignore``

An exit signal, carried as the ``error`` of an exit reason and never raised at a caller::

    LinkedExit ....................... a linked actor exited
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from actors._exit import ExitReason

__all__ = [
    "ActorCrashed",
    "ActorError",
    "ActorNotRunning",
    "ActorRestarting",
    "AskTimeout",
    "Ignore",
    "MailboxFull",
    "ReplyError",
    "StreamCancelled",
    "UnhandledMessage",
]


class ActorError(Exception):
    """Base of every error the runtime raises at a caller."""


class ActorNotRunning(ActorError):
    """The actor is not running (never started, stopped, or dead and not restarting)."""

    def __init__(self, name: str, reason: ExitReason | None = None) -> None:
        detail = f" (exited: {reason})" if reason is not None else ""
        super().__init__(f"actor {name!r} is not running{detail}")
        self.name = name
        self.reason = reason


class ActorRestarting(ActorNotRunning):
    """The actor is waiting to be restarted by its supervisor (backing off)."""

    def __init__(self, name: str, reason: ExitReason | None = None) -> None:
        super().__init__(name, reason)
        self.args = (f"actor {name!r} is restarting",)


class ActorCrashed(ActorError):
    """The actor died while this call was pending or being handled."""

    def __init__(self, name: str, reason: ExitReason) -> None:
        super().__init__(f"actor {name!r} died: {reason}")
        self.name = name
        self.reason = reason


class AskTimeout(ActorError, TimeoutError):
    """No reply came within the ask's timeout."""


class MailboxFull(ActorError):
    """``tell_nowait`` found the mailbox at capacity."""


class StreamCancelled(ActorError):
    """The consumer closed a reply stream; raised inside the producing handler's task."""


class UnhandledMessage(ActorError):
    """The actor has no handler for a message (a bug in the sender): it crashes the actor."""


class ReplyError(Exception):
    """Raise (a subclass of) this in a handler to answer the caller with an error.

    The actor keeps running: this is a reply, not a failure. Any other exception in a handler
    crashes the actor ("let it crash") and its supervisor decides what happens next.
    """


class Ignore(Exception):
    """Raise from :meth:`Actor.started` to start as OTP's ``ignore``: the child spec is kept,
    nothing runs."""
