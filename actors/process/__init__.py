"""Process actors: the same ActorRef API for an actor running in its own OS process.

Engines run this way so a CUDA fault or an OOM kill cannot take the root down. The wire is ZMQ
(``ipc://`` by default, ``tcp://127.0.0.1`` as an option) with :mod:`protocols.codec` messages,
never pickle. Death is detected through the process sentinel, hangs through heartbeats.
"""

from actors._errors import ReplyError
from actors.process._parent import ProcessActor, ProcessDied, ProcessOptions
from actors.process._spawn import preload
from protocols import codec

# A handler's ReplyError crosses the boundary as itself.
codec.register_error(ReplyError, "actors.ReplyError")

__all__ = ["ProcessActor", "ProcessDied", "ProcessOptions", "preload"]
