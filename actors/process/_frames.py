"""Frames between a parent and its process actor.

Every message is two ZMQ frames: a 9-byte header (kind, then a 64-bit big-endian correlation id)
and a body (``protocols.codec`` bytes, or empty). Credits for streams travel as 4-byte integers.
"""

from __future__ import annotations

__all__ = ["header", "parse_header"]

# parent -> child
TELL = 1
ASK = 2
STREAM = 3
CREDIT = 4
CANCEL = 5
STOP = 6
# child -> parent
READY = 20
START_FAILED = 21
REPLY = 22
ERROR = 23
ITEM = 24
END = 25
HEARTBEAT = 26
EXIT = 27


def header(kind: int, corr: int = 0) -> bytes:
    return kind.to_bytes(1, "big") + corr.to_bytes(8, "big")


def parse_header(data: bytes) -> tuple[int, int]:
    return data[0], int.from_bytes(data[1:9], "big")
