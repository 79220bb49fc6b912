"""SGLang's wire formats for KV events and scheduler load metrics (no pickle anywhere).

KV events follow ``sglang/srt/disaggregation/kv_events.py``: msgspec ``array_like`` structs, the
events tagged by class name, so a batch encodes as
``[ts, [["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium], ...], dp_rank]``.
Older SGLang versions lack the trailing ``medium`` / ``attn_dp_rank`` fields; they have defaults,
so batches from either version decode. A batch travels as three ZMQ frames
``(topic, seq as 8-byte big-endian, msgpack payload)``; the replay socket answers
``(seq, payload)`` frames and ends with sequence ``-1`` and an empty payload.

Load metrics carry SGLang's ``KvMetrics`` fields (a msgpack map with those names) instead of the
pickled dataclass SGLang pushes.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVCacheEvent",
    "KVEvent",
    "KVEventBatch",
    "KvMetrics",
    "decode_kv_event_batch",
    "decode_kv_metrics",
    "decode_seq",
    "encode_kv_event_batch",
    "encode_kv_metrics",
    "encode_seq",
]

END_SEQ = -1


class KVCacheEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    """Base of the KV cache events (tagged by class name, encoded as arrays)."""


class BlockStored(KVCacheEvent):
    """Pages entered the prefix cache: a parent-linked chain of ``block_hashes``."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(KVCacheEvent):
    """Pages left the prefix cache."""

    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was dropped (flush, memory release)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    """The events of one scheduler step."""

    ts: float
    events: list[KVEvent]
    attn_dp_rank: int | None = None


class KvMetrics(msgspec.Struct, kw_only=True):
    """SGLang's scheduler load metrics (``KvMetrics``), one message per rank."""

    request_active_slots: int
    request_total_slots: int
    kv_active_blocks: int
    kv_total_blocks: int
    num_requests_waiting: int
    gpu_cache_usage_perc: float  # fraction in [0, 1], as Dynamo's gauge reads it
    gpu_prefix_cache_hit_rate: float  # fraction in [0, 1]
    data_parallel_rank: int | None = None


_batch_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_metrics_encoder = msgspec.msgpack.Encoder()
_metrics_decoder = msgspec.msgpack.Decoder(KvMetrics)


def encode_kv_event_batch(batch: KVEventBatch) -> bytes:
    return _batch_encoder.encode(batch)


def decode_kv_event_batch(payload: bytes | memoryview) -> KVEventBatch:
    """Decode one KV event batch payload (the third frame); raises ``msgspec.DecodeError``."""
    return _batch_decoder.decode(payload)


def encode_kv_metrics(metrics: KvMetrics) -> bytes:
    return _metrics_encoder.encode(metrics)


def decode_kv_metrics(payload: bytes | memoryview) -> KvMetrics:
    """Decode one load metrics message; raises ``msgspec.DecodeError``."""
    return _metrics_decoder.decode(payload)


def encode_seq(seq: int) -> bytes:
    """An 8-byte big-endian sequence number (``-1`` marks the end of a replay)."""
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)
