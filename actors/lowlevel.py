"""What supervisors, process actors and the serving application build on: cells, incarnations,
mailbox item kinds, the per-loop wake-ups, ZMQ on the event loop, deadlines and loopback ports.

Not for applications: use :mod:`actors` and :mod:`supervisors`.
"""

from actors._backends import Backend, Parking, Reply, backend, default_loop, run_on
from actors._mailbox import ASK, ASK_ABORTABLE, STREAM, TELL, Item, Mailbox
from actors._net import LOOPBACK, free_port
from actors._ref import Cell, CellState, Inbox, crash_error
from actors._registry import reset_registry, set_registry
from actors._runtime import OWNER_GONE, Incarnation, unwrap_error
from actors._stream import StreamChannel, StreamHooks
from actors._timeouts import Deadlines
from actors._zmq import AsyncSocket, has_input

__all__ = [
    "ASK",
    "ASK_ABORTABLE",
    "LOOPBACK",
    "OWNER_GONE",
    "STREAM",
    "TELL",
    "AsyncSocket",
    "Backend",
    "Cell",
    "CellState",
    "Deadlines",
    "Inbox",
    "Incarnation",
    "Item",
    "Mailbox",
    "Parking",
    "Reply",
    "StreamChannel",
    "StreamHooks",
    "backend",
    "crash_error",
    "default_loop",
    "free_port",
    "has_input",
    "reset_registry",
    "run_on",
    "set_registry",
    "unwrap_error",
]
