"""Process actors: the same ActorRef API for an actor running in its own OS process.

Engines run this way so a CUDA fault or an OOM kill cannot take the root down. The wire carries
:mod:`protocols.codec` messages, never pickle, over a Unix-domain stream socket by default
(``transport="unix"``) or ZMQ (``"ipc"``, or ``"tcp"`` on 127.0.0.1, the cross-host path). Death
is detected through the process sentinel, hangs through heartbeats, a closed socket by the link.
"""

from actors._backends._loops import default_loop
from actors._errors import ReplyError
from actors.process._link import LinkBroken, Transport
from actors.process._parent import ProcessActor, ProcessDied, ProcessOptions
from actors.process._spawn import preload
from protocols import codec

# A handler's ReplyError crosses the boundary as itself.
codec.register_error(ReplyError, "actors.ReplyError")

__all__ = [
    "LinkBroken",
    "ProcessActor",
    "ProcessDied",
    "ProcessOptions",
    "Transport",
    "default_loop",
    "preload",
]
