"""The actor core: actors, refs, mailboxes, monitors, links and names, on anyio.

Every actor runs on asyncio and on trio. ``from actors import Actor, ActorRef`` is the usual start;
supervisors (in the ``supervisors`` package) own and restart actors.
"""

from actors._actor import Actor, Exit, LinkedExit
from actors._clock import Clock, RealClock, VirtualClock
from actors._errors import (
    ActorCrashed,
    ActorError,
    ActorNotRunning,
    ActorRestarting,
    AskTimeout,
    Ignore,
    MailboxFull,
    ReplyError,
    StreamCancelled,
    UnhandledMessage,
)
from actors._exit import ExitReason
from actors._ref import (
    DEFAULT_ASK_TIMEOUT,
    ActorRef,
    ActorStatistics,
    Call,
    Down,
    Monitor,
    WhileRestarting,
)
from actors._registry import NameTaken, Registry, current_registry
from actors._stream import ReplyStream

__all__ = [
    "DEFAULT_ASK_TIMEOUT",
    "Actor",
    "ActorCrashed",
    "ActorError",
    "ActorNotRunning",
    "ActorRef",
    "ActorRestarting",
    "ActorStatistics",
    "AskTimeout",
    "Call",
    "Clock",
    "Down",
    "Exit",
    "ExitReason",
    "Ignore",
    "LinkedExit",
    "MailboxFull",
    "Monitor",
    "NameTaken",
    "RealClock",
    "Registry",
    "ReplyError",
    "ReplyStream",
    "StreamCancelled",
    "UnhandledMessage",
    "VirtualClock",
    "WhileRestarting",
    "current_registry",
]
