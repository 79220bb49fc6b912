"""What supervisors and process actors build on: cells, incarnations, mailbox item kinds.

Not for applications: use :mod:`actors` and :mod:`supervisors`.
"""

from actors._backend import Backend, Parking, Reply, backend
from actors._mailbox import ASK, ASK_ABORTABLE, STREAM, TELL, Item, Mailbox
from actors._ref import Cell, CellState, Inbox, crash_error
from actors._registry import reset_registry, set_registry
from actors._runtime import OWNER_GONE, Incarnation, unwrap_error
from actors._stream import StreamChannel, StreamHooks

__all__ = [
    "ASK",
    "ASK_ABORTABLE",
    "OWNER_GONE",
    "STREAM",
    "TELL",
    "Backend",
    "Cell",
    "CellState",
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
    "reset_registry",
    "set_registry",
    "unwrap_error",
]
