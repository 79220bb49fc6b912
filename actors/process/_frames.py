"""Messages between a parent and its process actor.

A message is a kind, a correlation id and a body (``protocols.codec`` bytes, a 4-byte credit, or
nothing); a link sends and delivers the three (:meth:`Link.send`, its message handler). On the
wire it is one link message (one ZMQ frame, or one length-prefixed frame of a unix link): a 9-byte
header (kind, then a 64-bit big-endian correlation id) followed by the body. One message rather
than a header and a body: the per-message cost (pyzmq's Python-level cost per frame, a syscall) is
a good part of a message's cost. A stream's items travel in batches (``ITEMS``,
``protocols.codec.encode_many``), and its last batch rides on ``END``.
"""

from __future__ import annotations

import struct

__all__ = ["Body", "message", "parse"]

# A received body: the bytes after the header, or a view of a message nobody else writes to.
Body = bytes | bytearray | memoryview

# parent -> child
TELL = 1
ASK = 2
STREAM = 3  # body: 4-byte credit, then the request
CREDIT = 4  # body: 4-byte count
CANCEL = 5
STOP = 6
# child -> parent
READY = 20
START_FAILED = 21
REPLY = 22
ERROR = 23
ITEMS = 24  # a batch of stream items
END = 25  # the stream's last batch (possibly empty): the stream is finished
HEARTBEAT = 26
EXIT = 27

_HEADER = struct.Struct(">BQ")
_COUNT = struct.Struct(">I")
HEADER_SIZE = _HEADER.size
count = _COUNT.pack


def message(kind: int, corr: int = 0, body: bytes = b"") -> bytes:
    return _HEADER.pack(kind, corr) + body


def parse(data: bytes | bytearray) -> tuple[int, int, memoryview]:
    """``(kind, corr, body)``; the body is a view of ``data``, not a copy (``data`` must not be
    reused)."""
    kind, corr = _HEADER.unpack_from(data)
    return kind, corr, memoryview(data)[HEADER_SIZE:]


def parse_count(body: Body) -> int:
    value: int = _COUNT.unpack_from(body)[0]
    return value
