"""The engine side of the publishers: KV events (PUB + ROUTER replay) and load metrics (PUB).

``KvEventPublisher`` is SGLang's ``ZmqEventPublisher`` behaviour without its thread: the scheduler
publishes a step's batch inline (a PUB send never blocks: at the high-water mark ZMQ drops, which is
what the replay socket is for), and a task serves replay requests. ``MetricsPublisher`` sends one
single-frame msgpack ``KvMetrics`` per message on a PUB socket every rank shares (SGLang pushes to
one PULL socket; PUB lets any number of subscribers connect, and never blocks the scheduler).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

import anyio
import anyio.abc
import zmq

from actors.lowlevel import AsyncSocket
from protocols.kv_events import (
    END_SEQ,
    KVEvent,
    KVEventBatch,
    KvMetrics,
    decode_seq,
    encode_kv_event_batch,
    encode_kv_metrics,
    encode_seq,
)

__all__ = ["KvEventPublisher", "MetricsPublisher"]

_END_FRAME = encode_seq(END_SEQ)


class KvEventPublisher:
    """One data-parallel rank's KV event stream, with its replay buffer."""

    def __init__(
        self,
        rank: int,
        endpoint: str,
        replay_endpoint: str | None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
    ) -> None:
        self.rank = rank
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._pub: AsyncSocket | None = AsyncSocket.create(zmq.PUB, sndhwm=hwm)
        self._replay: AsyncSocket | None = None
        try:
            self.endpoint = self._pub.bind(endpoint)
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                # MANDATORY makes a full pipe push back instead of silently dropping replay frames.
                self._replay = AsyncSocket.create(
                    zmq.ROUTER, sndhwm=buffer_steps + 16, router_mandatory=1
                )
                self.replay_endpoint = self._replay.bind(replay_endpoint)
        except BaseException:
            self.close()
            raise

    @property
    def last_seq(self) -> int:
        """The sequence number of the last published batch (-1 before the first)."""
        return self._next_seq - 1

    def publish(self, events: Sequence[KVEvent]) -> int:
        """Send one batch now; returns its sequence number."""
        batch = KVEventBatch(ts=time.time(), events=list(events), attn_dp_rank=self.rank)
        payload = encode_kv_event_batch(batch)
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        if self._pub is not None:
            self._pub.send_multipart_nowait((self._topic, encode_seq(seq), payload))
        return seq

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled (one task per rank)."""
        sock = self._replay
        if sock is None:
            await anyio.sleep_forever()
            return
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # not ``(identity, b"", start_seq)``: ignore, as SGLang does
            ident, start = frames[0], decode_seq(frames[2])
            # Snapshot first: the scheduler may append while a slow client makes us wait.
            wanted = [item for item in self._buffer if item[0] >= start]
            try:
                for seq, payload in wanted:
                    await sock.send_multipart((ident, b"", encode_seq(seq), payload))
                await sock.send_multipart((ident, b"", _END_FRAME, b""))
            except zmq.ZMQError:
                continue  # the client went away (EHOSTUNREACH): serve the next one

    def close(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close()
        self._pub = self._replay = None


class MetricsPublisher:
    """The shared load-metrics PUB socket (every rank publishes on it)."""

    def __init__(self, endpoint: str) -> None:
        self._sock: AsyncSocket | None = AsyncSocket.create(zmq.PUB, sndhwm=1000)
        try:
            self.endpoint = self._sock.bind(endpoint)
        except BaseException:
            self.close()
            raise

    def publish(self, metrics: KvMetrics) -> None:
        if self._sock is not None:
            self._sock.send_multipart_nowait((encode_kv_metrics(metrics),))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
