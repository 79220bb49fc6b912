"""The subscriber side: decode KV event batches and load metrics, and recover missed batches.

These work against the mock engine and against SGLang alike (same frames, same payloads), so the
publisher actor can use them for either backend:

- :class:`KvEventSubscriber`: a SUB socket on one rank's KV events; it checks sequence numbers and
  fills gaps (a late join, a dropped message) from the rank's replay socket, so ``receive`` hands
  out every batch exactly once and in order, or counts what the replay buffer no longer had. A
  gap is revealed by the next batch, or, when none comes, by a catch-up after a quiet spell.
- :func:`replay_kv_events`: one replay request (a DEALER speaking to SGLang's ROUTER).
- :class:`KvMetricsSubscriber`: a SUB socket on the load metrics.
"""

from __future__ import annotations

from types import TracebackType
from typing import Self

import anyio
import msgspec
import zmq

from actors.lowlevel import AsyncSocket
from protocols.kv_events import (
    END_SEQ,
    KVEventBatch,
    KvMetrics,
    decode_kv_event_batch,
    decode_kv_metrics,
    decode_seq,
    encode_seq,
)

__all__ = [
    "KvEventSubscriber",
    "KvEventSubscriberStatistics",
    "KvMetricsSubscriber",
    "replay_kv_events",
]


async def replay_kv_events(
    replay_endpoint: str, start_seq: int, *, timeout_s: float = 5.0
) -> list[tuple[int, KVEventBatch]]:
    """Every buffered batch with sequence >= ``start_seq``, in order (raises ``TimeoutError``)."""
    sock = AsyncSocket.create(zmq.DEALER)
    out: list[tuple[int, KVEventBatch]] = []
    try:
        sock.connect(replay_endpoint)
        with anyio.fail_after(timeout_s):
            # A DEALER adds no delimiter: send the empty frame a REQ socket would have sent.
            await sock.send_multipart((b"", encode_seq(start_seq)))
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 3:
                    continue
                seq = decode_seq(frames[1])
                if seq == END_SEQ:
                    return out
                out.append((seq, decode_kv_event_batch(frames[2])))
    finally:
        sock.close()


#: The longest wait between two quiet catch-ups that found nothing.
_MAX_QUIET_S = 8.0


class KvEventSubscriberStatistics(msgspec.Struct, frozen=True, kw_only=True):
    received: int  # batches handed out
    replayed: int  # of which recovered through the replay socket
    missed: int  # batches lost for good (no longer in the replay buffer)
    undecodable: int  # payloads that failed to decode (skipped)


class _Subscription:
    """One SUB socket on ``endpoint``, made by ``connect`` (or ``async with``)."""

    _topic = b""
    _rcvhwm = 1000  # ZMQ's default

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._sock: AsyncSocket | None = None

    def connect(self) -> None:
        if self._sock is None:
            sock = AsyncSocket.create(zmq.SUB, rcvhwm=self._rcvhwm)
            sock.socket.setsockopt(zmq.SUBSCRIBE, self._topic)
            sock.connect(self.endpoint)
            self._sock = sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def drop(self) -> None:
        """Close the socket under a task waiting in ``receive`` (it raises
        ``ClosedResourceError``): a dropped connection, for fault injection."""
        if self._sock is not None:
            self._sock.abort()
            self._sock = None

    async def __aenter__(self) -> Self:
        self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class KvEventSubscriber(_Subscription):
    """In-order, gap-free KV event batches of one data-parallel rank.

    ``start_seq=0`` also recovers what was published before this subscriber joined (as far as
    the replay buffer reaches); ``None`` starts with the first batch that arrives.

    After ``idle_catch_up_s`` without a batch, ``receive`` asks the replay socket for anything
    newer (best effort: an engine that does not answer is the health checker's business). A
    SUB socket receives nothing until its subscription reached the publisher, so without this
    the batches of a worker's first request could stay missing until its next one. Each quiet
    catch-up that finds nothing doubles the wait for the next (up to ``_MAX_QUIET_S``), and a
    batch resets it: an idle worker's catch-ups (a socket made, connected and closed, a replay
    on the engine's side) cost the root about 3% of its CPU at twice a second.
    """

    _rcvhwm = 100_000  # a burst of batches must not be dropped before they are read

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        start_seq: int | None = None,
        replay_timeout_s: float = 5.0,
        idle_catch_up_s: float | None = 0.5,
    ) -> None:
        super().__init__(endpoint)
        self.replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._next: int | None = start_seq
        self._timeout = replay_timeout_s
        self._idle = idle_catch_up_s if replay_endpoint is not None else None
        self._quiet = self._idle  # the wait before the next quiet catch-up
        self._received = self._replayed = self._missed = self._undecodable = 0

    @property
    def next_seq(self) -> int | None:
        """The sequence number expected next (``None`` before the first batch)."""
        return self._next

    def statistics(self) -> KvEventSubscriberStatistics:
        return KvEventSubscriberStatistics(
            received=self._received,
            replayed=self._replayed,
            missed=self._missed,
            undecodable=self._undecodable,
        )

    async def catch_up(self) -> list[tuple[int, KVEventBatch]]:
        """Replay from the next expected sequence (from 0 before any batch) right now."""
        if self.replay_endpoint is None:
            return []
        return self._accept_replayed(
            await replay_kv_events(self.replay_endpoint, self._next or 0, timeout_s=self._timeout)
        )

    async def receive(self) -> list[tuple[int, KVEventBatch]]:
        """Wait for the next batch; returns it, preceded by any recovered missing batches."""
        if self._sock is None:
            raise RuntimeError("KvEventSubscriber is not connected")
        while True:
            sock = self._sock
            if sock is None:
                raise anyio.ClosedResourceError  # dropped during a catch-up
            frames = sock.recv_multipart_nowait()
            if frames is None:
                # Quiet spells end in a catch-up only once there is a sequence to catch up from.
                with anyio.move_on_after(None if self._next is None else self._quiet):
                    frames = await sock.recv_multipart()
            if frames is None:
                try:
                    recovered = await self.catch_up()
                except (TimeoutError, zmq.ZMQError):
                    continue
                if recovered:
                    self._quiet = self._idle
                    return recovered
                if self._quiet is not None:
                    self._quiet = min(self._quiet * 2, max(_MAX_QUIET_S, self._quiet))
                continue
            self._quiet = self._idle
            if len(frames) != 3 or len(frames[1]) != 8:
                self._undecodable += 1
                continue
            seq = decode_seq(frames[1])
            if self._next is not None and seq < self._next:
                continue  # already handed out (through a replay)
            out: list[tuple[int, KVEventBatch]] = []
            if self._next is not None and seq > self._next and self.replay_endpoint is not None:
                replayed = await replay_kv_events(
                    self.replay_endpoint, self._next, timeout_s=self._timeout
                )
                out = self._accept_replayed([(s, b) for s, b in replayed if s < seq])
            if self._next is not None and seq > self._next:
                self._missed += seq - self._next  # the replay buffer no longer had them
            try:
                batch = decode_kv_event_batch(frames[2])
            except msgspec.DecodeError:
                self._undecodable += 1
                self._next = seq + 1
                if out:
                    return out
                continue
            self._next = seq + 1
            self._received += 1
            out.append((seq, batch))
            return out

    def _accept_replayed(
        self, replayed: list[tuple[int, KVEventBatch]]
    ) -> list[tuple[int, KVEventBatch]]:
        out: list[tuple[int, KVEventBatch]] = []
        for seq, batch in replayed:
            if self._next is not None and seq < self._next:
                continue
            if self._next is not None and seq > self._next:
                self._missed += seq - self._next
            out.append((seq, batch))
            self._next = seq + 1
        self._received += len(out)
        self._replayed += len(out)
        return out


class KvMetricsSubscriber(_Subscription):
    """Load metrics (every rank's) from the engine's metrics endpoint."""

    async def receive(self) -> KvMetrics:
        """The next metrics message (undecodable ones are skipped)."""
        if self._sock is None:
            raise RuntimeError("KvMetricsSubscriber is not connected")
        while True:
            frames = await self._sock.recv_multipart()
            try:
                return decode_kv_metrics(frames[-1])
            except msgspec.DecodeError:
                continue

    def receive_nowait(self) -> KvMetrics | None:
        """The next queued message, or ``None``."""
        if self._sock is None:
            raise RuntimeError("KvMetricsSubscriber is not connected")
        while (frames := self._sock.recv_multipart_nowait()) is not None:
            try:
                return decode_kv_metrics(frames[-1])
            except msgspec.DecodeError:
                continue
        return None
