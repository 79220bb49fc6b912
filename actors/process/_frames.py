"""Messages between a parent and its process actor.

Every message is one link message (one ZMQ frame, or one length-prefixed frame of a unix link):
a 9-byte header (kind, then a 64-bit big-endian correlation id) followed by the body
(``protocols.codec`` bytes, a 4-byte credit, or nothing). One message rather than a header and a
body: the per-message cost (pyzmq's Python-level cost per frame, a syscall) is a good part of a
message's cost. A stream's items travel in batches (``ITEMS``, ``protocols.codec.encode_many``),
and its last batch rides on ``END``.
"""

from __future__ import annotations

import struct

__all__ = ["message", "parse"]

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
header = _HEADER.pack
count = _COUNT.pack


def message(kind: int, corr: int = 0, body: bytes = b"") -> bytes:
    return _HEADER.pack(kind, corr) + body


def parse(data: bytes | bytearray) -> tuple[int, int, memoryview]:
    """``(kind, corr, body)``; the body is a view, not a copy."""
    kind, corr = _HEADER.unpack_from(data)
    return kind, corr, memoryview(data)[HEADER_SIZE:]


def parse_count(body: memoryview) -> int:
    value: int = _COUNT.unpack_from(body)[0]
    return value
