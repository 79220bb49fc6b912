"""Wire messages of the KV bootstrap channel between a decode worker and a prefill worker.

Semantics follow SGLang's PD disaggregation: each prefill worker owns a bootstrap endpoint (a ZMQ
ROUTER); a request gets a random 63-bit *room*; the decode worker, concurrently with prefill,
allocates KV pages and sends ``room -> page list`` to the prefill worker; prefill WRITEs its pages
into the decode worker's registered pool with NIXL and the transfer's NIXL notification (a
:class:`TransferNotification`) tells decode that the room's pages have landed.

Decode -> prefill: :class:`Hello` (once per peer pair and incarnation: the NIXL agent metadata and
the pool's layout), :class:`TransferRequest`, :class:`CancelRoom`, :class:`Ping`, :class:`Goodbye`.

Prefill -> decode: :class:`Welcome` / :class:`Reject` (answer to ``Hello``), :class:`Writing`
(the WRITE is about to be posted: poll hard now), :class:`RoomClosed` (nothing more will be written
into the room's pages), :class:`RoomFailed` (the room ended badly; also implies closed),
:class:`Pong`, :class:`UnknownPeer` (send ``Hello`` again: prefill restarted or forgot you).

Everything is a ``msgspec`` struct encoded with msgpack; nothing is pickled. Page lists travel as
packed little-endian int64 (decoding a long list of ints costs far more than packed bytes).
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = [
    "ROOM_BITS",
    "BootstrapMessage",
    "CancelRoom",
    "Goodbye",
    "Hello",
    "KVMemoryDesc",
    "MemoryKind",
    "Ping",
    "Pong",
    "Reject",
    "RoomClosed",
    "RoomFailed",
    "TransferNotification",
    "TransferRequest",
    "UnknownPeer",
    "Welcome",
    "Writing",
    "decode_message",
    "decode_notification",
    "decode_notifications",
    "encode_message",
    "encode_notification",
    "encode_notifications",
]

ROOM_BITS = 63
"""Rooms are random non-negative 63-bit integers, as in SGLang."""

MemoryKind = Literal["DRAM", "VRAM"]


class KVMemoryDesc(msgspec.Struct, frozen=True, kw_only=True):
    """Where a worker's KV pool lives: ``num_pages`` pages of ``page_bytes`` from ``base_addr``."""

    mem_type: MemoryKind
    device_id: int
    base_addr: int
    num_pages: int
    page_bytes: int


class Hello(msgspec.Struct, frozen=True, kw_only=True, tag="hello"):
    """Decode introduces itself: sent when the peers first meet and after either restarts.

    ``incarnation`` changes on every restart of the decode worker (its NIXL agent), also when the
    worker id and even the agent name stay the same: prefill then drops the stale remote agent
    before loading the new metadata.
    """

    worker_id: str
    agent_name: str
    incarnation: int
    agent_metadata: bytes
    memory: KVMemoryDesc


class Welcome(msgspec.Struct, frozen=True, kw_only=True, tag="welcome"):
    """Prefill loaded decode's metadata and can WRITE into its pool."""

    worker_id: str
    agent_name: str
    incarnation: int
    page_bytes: int


class Reject(msgspec.Struct, frozen=True, kw_only=True, tag="reject"):
    """Prefill refused a ``Hello`` (page size mismatch, metadata that would not load)."""

    reason: str


class TransferRequest(msgspec.Struct, frozen=True, kw_only=True, tag="request"):
    """Decode's page list for a room: ``pages`` is packed little-endian int64 page indices."""

    room: int
    pages: bytes
    want_checksums: bool = True


class CancelRoom(msgspec.Struct, frozen=True, kw_only=True, tag="cancel"):
    """Decode gave up on a room (cancelled, timed out); prefill answers ``RoomClosed``."""

    room: int


class Writing(msgspec.Struct, frozen=True, kw_only=True, tag="writing"):
    """Prefill is about to post the room's WRITE (with the ``more`` rooms' that share it):
    decode polls NIXL hard until it lands."""

    room: int
    more: list[int] = msgspec.field(default_factory=list)


class RoomClosed(msgspec.Struct, frozen=True, kw_only=True, tag="closed"):
    """Nothing more will be written into the room's decode pages: decode may reuse them."""

    room: int


class RoomFailed(msgspec.Struct, frozen=True, kw_only=True, tag="failed"):
    """The room ended without its KV (``code``/``message`` as in :mod:`protocols.errors`).

    Also a promise that nothing more will be written into the room's decode pages.
    """

    room: int
    code: str
    message: str


class Ping(msgspec.Struct, frozen=True, kw_only=True, tag="ping"):
    """Decode's heartbeat; also how prefill learns that a decode peer is alive."""

    seq: int


class Pong(msgspec.Struct, frozen=True, kw_only=True, tag="pong"):
    """Prefill's answer to a ``Ping``; a changed ``incarnation`` means prefill restarted."""

    seq: int
    incarnation: int


class Goodbye(msgspec.Struct, frozen=True, kw_only=True, tag="bye"):
    """Decode leaves gracefully: prefill aborts its rooms and removes its remote agent."""


class UnknownPeer(msgspec.Struct, frozen=True, kw_only=True, tag="unknown"):
    """Prefill does not know the sender (it restarted, or reaped the peer): send ``Hello``."""


BootstrapMessage = (
    Hello
    | Welcome
    | Reject
    | TransferRequest
    | CancelRoom
    | Writing
    | RoomClosed
    | RoomFailed
    | Ping
    | Pong
    | Goodbye
    | UnknownPeer
)


class TransferNotification(msgspec.Struct, frozen=True, array_like=True):
    """The payload of the room's NIXL notification (one per room, sent when its WRITE is done).

    ``checksums`` holds one little-endian uint64 per page, in the order of the request's page
    list, or nothing when decode did not ask for them. ``aux`` is engine-defined data that
    travels with the room's KV (as SGLang's aux buffers carry the first output token): an
    engine whose decode side cannot recompute the first token sends it here. Both fields
    default to empty, so an older sender's shorter array still decodes.
    """

    room: int
    checksums: bytes = b""
    aux: bytes = b""


_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[BootstrapMessage] = msgspec.msgpack.Decoder(BootstrapMessage)
_notif_decoder = msgspec.msgpack.Decoder(TransferNotification)
_notifs_decoder = msgspec.msgpack.Decoder(list[TransferNotification])


def encode_message(msg: BootstrapMessage) -> bytes:
    """Encode one bootstrap-channel message."""
    return _encoder.encode(msg)


def decode_message(data: bytes) -> BootstrapMessage:
    """Decode one bootstrap-channel message (``msgspec.ValidationError`` / ``DecodeError``)."""
    return _decoder.decode(data)


def encode_notification(msg: TransferNotification) -> bytes:
    """Encode a NIXL notification payload."""
    return _encoder.encode(msg)


def decode_notification(data: bytes) -> TransferNotification:
    """Decode a NIXL notification payload."""
    return _notif_decoder.decode(data)


def encode_notifications(msgs: list[TransferNotification]) -> bytes:
    """Encode the payload of a WRITE shared by several rooms: each room's notification."""
    return _encoder.encode(msgs)


def decode_notifications(data: bytes) -> list[TransferNotification]:
    """Decode a NIXL notification payload: one room's, or a shared WRITE's rooms'."""
    try:
        return [_notif_decoder.decode(data)]
    except msgspec.ValidationError:
        return _notifs_decoder.decode(data)
