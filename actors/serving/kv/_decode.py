"""The decode side: connections to prefill bootstrap endpoints, and receiving rooms.

:meth:`DecodeKV.receive` sends a room's page list to its prefill worker, waits (bounded) for the
room's NIXL notification, and verifies the pages against the checksums that came with it (or the
engine's own). On every failure it raises a typed, migratable error:
:class:`~protocols.errors.KVTransferError` (prefill died or failed the room, timeout) or
:class:`~protocols.errors.KVCorrupted`.

Page ownership: the caller's :class:`~actors.serving.kv.PageAllocation` stays the caller's when
``receive`` returns. When it raises (cancellation included), the allocation passes to the
service, which frees it once nothing can write into it any more: at once if prefill never had
the page list or already ended the room; otherwise after prefill confirms (``RoomClosed``,
``RoomFailed``, the notification) or is declared dead. Until then the pages are *quarantined*,
never handed to another request.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import anyio.abc
import anyio.lowlevel
import msgspec
import numpy as np
import numpy.typing as npt
import zmq

from actors.lowlevel import AsyncSocket, Deadlines, backend
from actors.serving.kv._bootstrap import KVConfig, bootstrap_endpoint, pack_pages
from actors.serving.kv._checksum import page_checksums
from actors.serving.kv._conn import PendingRoom, PrefillConnection
from actors.serving.kv._nixl import NixlAgent
from actors.serving.kv._pool import KVPool, PageAllocation
from actors.serving.kv._transfer import yield_cpu
from protocols.engine import BootstrapInfo
from protocols.errors import KVCorrupted, KVTransferError
from protocols.kv import Goodbye, Hello, TransferRequest, decode_notifications

__all__ = ["DecodeKV", "DecodeStatistics", "ExpectedChecksums", "ReceivedKV"]

ExpectedChecksums = npt.NDArray[np.uint64] | Callable[[], npt.NDArray[np.uint64]]
"""The pages' expected checksums, or a callable computing them (from the request's tokens)."""

# A receive drives NIXL itself unless someone (the poller, another receive) did within this
# long: a drain's burst of receives on one event loop then polls about once per this much work,
# not twice per receive (a poll, ``get_notifs``, costs a sizeable part of an open's work).
_RECEIVE_PROGRESS_GAP_S = 0.0002


class _Timeout:
    """One receive's timeout in the event loop's deadline sweep (``actors._timeouts``): no
    timer or cancel scope per receive. Expiring only wakes the receive: the room stays
    pending (not terminal), so its pages are quarantined as on any other failure."""

    __slots__ = ("done", "expired", "pending")

    def __init__(self, pending: PendingRoom) -> None:
        self.pending = pending
        self.done = False  # the receive is over: the sweep drops the entry
        self.expired = False

    def expire(self) -> None:
        if not self.done:
            self.expired = True
            self.pending.done.set()


@dataclass(frozen=True, slots=True)
class ReceivedKV:
    """A room's KV, landed and verified in the caller's pages."""

    room: int
    pages: PageAllocation
    checksums: npt.NDArray[np.uint64] | None
    verified: bool
    seconds: float
    aux: bytes = b""  # what prefill's ``PrefillRoom.send(aux=...)`` sent with the KV


@dataclass(frozen=True, slots=True)
class DecodeStatistics:
    """A decode KV service's connections, rooms and pages."""

    worker_id: str
    connections: int
    connections_ready: int
    rooms_pending: int
    rooms_done: int
    rooms_failed: int
    rooms_corrupted: int
    pages_quarantined: int
    bytes_received: int
    stray_notifications: int
    prefill_restarts_seen: int
    lazy_connects: int
    prewarm_failures: int


class DecodeKV:
    """The decode worker's KV service. Use ``async with DecodeKV(agent, pool) as kv:``.

    ``worker_id`` names this decode worker across restarts (a restarted worker says ``Hello``
    under the same id with a new incarnation, and prefill replaces the stale peer).
    """

    def __init__(
        self,
        agent: NixlAgent,
        pool: KVPool,
        *,
        worker_id: str | None = None,
        config: KVConfig | None = None,
    ) -> None:
        self.agent = agent
        self.pool = pool
        self.config = config or KVConfig()
        self.worker_id = worker_id or agent.name
        self._conns: dict[str, PrefillConnection] = {}
        self._pending: dict[int, PendingRoom] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self._hello: Hello | None = None
        self._poke: anyio.Event | None = None
        self._changed: anyio.Event | None = None  # made by a waiter: every room changes it
        self._deadlines: Deadlines | None = None  # the event loop's (set on entry)
        self._progressed = 0.0  # when NIXL was last driven (time.monotonic)
        self._stats = dict.fromkeys(
            ("done", "failed", "corrupted", "bytes", "stray", "lazy", "prewarm_failed", "restarts"),
            0,
        )

    async def __aenter__(self) -> DecodeKV:
        self.pool.register(self.agent)
        self._hello = Hello(
            worker_id=self.worker_id,
            agent_name=self.agent.name,
            incarnation=self.agent.incarnation,
            agent_metadata=self.agent.metadata(),
            memory=self.pool.memory_desc(),
        )
        self._poke = anyio.Event()
        self._deadlines = backend().deadlines
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._poll_notifications)
        self._tg.start_soon(self._heartbeat)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for conn in self._conns.values():
            conn.send(Goodbye())
            conn.lost(KVTransferError("decode KV service stopped"), release=True)
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(None, None, None)
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()

    # -- public API ---------------------------------------------------------------------------

    async def connect(self, endpoint: str) -> None:
        """Meet the prefill worker at ``endpoint`` (pre-warm: metadata exchanged, NIXL connected).

        Idempotent; waits up to ``peer_timeout`` for its ``Welcome``: a prefill that does not
        answer for that long is dead or hung, as for a peer it already knew.
        """
        conn = self._conns.get(endpoint)
        if conn is None:
            assert self._tg is not None and self._hello is not None, "use DecodeKV in async with"
            sock = AsyncSocket.create(
                zmq.DEALER, RECONNECT_IVL=50, RECONNECT_IVL_MAX=500, SNDHWM=0, RCVHWM=0
            )
            sock.connect(endpoint)
            conn = PrefillConnection(endpoint, sock, self._hello, self._poke_poller, self._notify)
            self._conns[endpoint] = conn
            self._tg.start_soon(conn.run)
            conn.say_hello()
        await conn.wait_ready(self.config.peer_timeout)

    def connect_soon(self, endpoint: str) -> None:
        """:meth:`connect` in the background (a pre-warm): the caller does not wait, and a peer
        that does not answer is only counted (a request to it fails and migrates)."""
        assert self._tg is not None, "use DecodeKV in async with"
        self._tg.start_soon(self._prewarm, endpoint)

    async def _prewarm(self, endpoint: str) -> None:
        try:
            await self.connect(endpoint)
        except KVTransferError:
            self._stats["prewarm_failed"] += 1

    async def receive(
        self,
        bootstrap: BootstrapInfo,
        pages: PageAllocation,
        *,
        expected_checksums: ExpectedChecksums | None = None,
        timeout: float | None = None,
        verify: bool | None = None,
    ) -> ReceivedKV:
        """Receive room ``bootstrap.room`` from its prefill worker into ``pages`` (of this pool).

        ``timeout`` (default ``receive_timeout``) bounds the wait from the request on, so it
        includes prefill's compute time. With ``expected_checksums`` the pages are checked
        against the engine's own expectation, else against the checksums prefill sent.
        ``verify`` overrides the configured verification for this room (``False`` skips the
        checksums on both sides). On any error (and on cancellation) ``pages`` pass to the
        service: see the module doc.
        """
        verify = self.config.verify if verify is None else verify
        if pages.pool is not self.pool or pages.freed:
            raise ValueError("pages must be a live allocation of this service's pool")
        room = bootstrap.room
        if room in self._pending:
            raise ValueError(f"room {room} is already being received")
        endpoint = bootstrap_endpoint(bootstrap)
        pending = PendingRoom(room, pages, anyio.Event())
        timer = _Timeout(pending)
        start = time.perf_counter()
        try:
            conn = self._conns.get(endpoint)
            if conn is None or not conn.settled:
                if conn is None:
                    self._stats["lazy"] += 1  # should have been pre-warmed with connect()
                await self.connect(endpoint)
                conn = self._conns[endpoint]
            pending.conn = conn
            pending.incarnation = conn.incarnation
            self._pending[room] = pending
            conn.rooms[room] = pending
            msg = TransferRequest(room=room, pages=pack_pages(pages.pages), want_checksums=verify)
            pending.sent = True
            conn.send(msg)
            self._progress(_RECEIVE_PROGRESS_GAP_S)
            assert self._deadlines is not None
            self._deadlines.add(self.config.receive_timeout if timeout is None else timeout, timer)
            await pending.done.wait()
            if pending.error is not None:
                raise pending.error
            if pending.notif is None:
                raise KVTransferError(f"room {room}: no KV from {endpoint} in time")
            # For the rooms still coming, before the caller's work on this one.
            self._progress(_RECEIVE_PROGRESS_GAP_S)
            sent = np.frombuffer(pending.notif.checksums, dtype="<u8").astype(np.uint64)
            aux = pending.notif.aux
            verified = verify and self._verify(room, pages, sent, expected_checksums)
        except BaseException:
            self._stats["failed"] += 1
            self._abandon(pending)
            raise
        finally:
            timer.done = True
            self._forget(pending)
        self._stats["done"] += 1
        self._stats["bytes"] += len(pages) * self.pool.page_bytes
        return ReceivedKV(
            room=room,
            pages=pages,
            checksums=sent if sent.size else None,
            verified=verified,
            seconds=time.perf_counter() - start,
            aux=aux,
        )

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no room is pending and no page is quarantined; ``False`` on timeout."""
        with anyio.move_on_after(timeout):
            while not self._idle():
                if self._changed is None:
                    self._changed = anyio.Event()
                await self._changed.wait()
        return self._idle()

    def _idle(self) -> bool:
        return not self._pending and not any(c.quarantine for c in self._conns.values())

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def statistics(self) -> DecodeStatistics:
        s = self._stats
        conns = self._conns.values()
        return DecodeStatistics(
            worker_id=self.worker_id,
            connections=len(self._conns),
            connections_ready=sum(1 for c in conns if c.ready),
            rooms_pending=len(self._pending),
            rooms_done=s["done"],
            rooms_failed=s["failed"],
            rooms_corrupted=s["corrupted"],
            pages_quarantined=sum(len(a) for c in conns for a in c.quarantine.values()),
            bytes_received=s["bytes"],
            stray_notifications=s["stray"],
            prefill_restarts_seen=s["restarts"] + sum(c.restarts_seen for c in conns),
            lazy_connects=s["lazy"],
            prewarm_failures=s["prewarm_failed"],
        )

    # -- internals --------------------------------------------------------------------------

    def _verify(
        self,
        room: int,
        pages: PageAllocation,
        sent: npt.NDArray[np.uint64],
        expected: ExpectedChecksums | None,
    ) -> bool:
        want = expected() if callable(expected) else expected
        if want is None:
            if not sent.size:
                return False
            want = sent
        got = page_checksums(self.pool, pages.pages)
        if want.shape != got.shape or not np.array_equal(want, got):
            self._stats["corrupted"] += 1
            bad = np.flatnonzero(want != got) if want.shape == got.shape else np.arange(got.size)
            raise KVCorrupted(
                f"room {room}: {bad.size} of {got.size} pages failed verification "
                f"(first: page {int(pages.pages[bad[0]])})"
            )
        return True

    def _abandon(self, pending: PendingRoom) -> None:
        """Take over a failed room's pages: free them now, or quarantine until prefill is done."""
        conn = pending.conn
        if pending.terminal or not pending.sent or conn is None or conn.incarnation is None:
            pending.pages.free()
        elif pending.incarnation != conn.incarnation:
            pending.pages.free()  # that prefill incarnation is gone: nothing can write any more
        else:
            conn.quarantine[pending.room] = pending.pages
            conn.cancel(pending.room)

    def _forget(self, pending: PendingRoom) -> None:
        if self._pending.get(pending.room) is pending:
            del self._pending[pending.room]
            self._notify()
        if pending.conn is not None:
            pending.conn.rooms.pop(pending.room, None)
            if pending.writing:
                pending.conn.writing -= 1
                pending.writing = False

    def _poke_poller(self) -> None:
        if self._poke is not None:
            self._poke.set()

    def _progress(self, gap: float = 0.0) -> None:
        """Drive NIXL once: UCX progress for the WRITEs coming in, and their notifications;
        skipped if that was done less than ``gap`` seconds ago.

        Besides the poller, each receive calls it (with a gap) as it sends its page list and as
        its KV has arrived: a burst of rooms (live migrations) is a burst of work on this event
        loop, and the WRITEs still in flight must not wait for the poller's turn after all of
        it."""
        now = time.monotonic()
        if now - self._progressed < gap:
            return
        self._progressed = now
        for sender, msgs in self.agent.get_notifs().items():
            for raw in msgs:
                self._dispatch(sender, raw)

    async def _poll_notifications(self) -> None:
        """Poll NIXL notifications: hard while a WRITE is announced (or, with
        ``poll_while_pending``, while any room is pending), gently otherwise.

        Completing a WRITE needs our UCX progress too (the transport's flush round trip), so
        while one is coming we poll without sleeping, yielding the CPU between polls, for up to
        ``spin_s`` per announcement, then at the event loop's 1 ms timer grain.
        """
        cfg = self.config
        spin_until = 0.0
        while True:
            self._progress()
            writing = any(c.writing for c in self._conns.values())
            if cfg.poll_while_pending and self._pending:
                if cfg.yields:
                    yield_cpu()
                await anyio.lowlevel.checkpoint()
            elif writing:
                now = time.monotonic()
                if not spin_until:
                    spin_until = now + cfg.spin_s
                if now < spin_until:
                    if cfg.yields:
                        yield_cpu()
                    await anyio.lowlevel.checkpoint()
                else:
                    await anyio.sleep(0.0005)
            else:
                spin_until = 0.0
                self._poke = anyio.Event()
                with anyio.move_on_after(cfg.idle_poll_s):
                    await self._poke.wait()

    def _dispatch(self, sender: str, raw: bytes) -> None:
        try:
            notifs = decode_notifications(raw)  # one room's, or those of a shared WRITE
        except (msgspec.DecodeError, msgspec.ValidationError):
            self._stats["stray"] += 1
            return
        for notif in notifs:
            pending = self._pending.get(notif.room)
            conn = pending.conn if pending is not None else None
            if pending is not None and conn is not None and conn.agent_name == sender:
                pending.finish(notif=notif)
            elif not any(
                c.agent_name == sender and c.release_quarantined(notif.room)
                for c in self._conns.values()
            ):
                self._stats["stray"] += 1

    async def _heartbeat(self) -> None:
        """Ping every prefill peer; one silent for ``peer_timeout`` is declared dead. A peer
        silent for ``bootstrap_timeout`` with nothing of ours left on it is forgotten (a restarted
        prefill has a new endpoint: its old one would be pinged for ever)."""
        cfg = self.config
        while True:
            now = time.monotonic()
            for endpoint, conn in list(self._conns.items()):
                conn.ping()
                silent = now - conn.last_seen
                if conn.ready and silent > cfg.peer_timeout:
                    conn.lost(KVTransferError(f"prefill at {conn.endpoint} lost (no heartbeat)"))
                elif not conn.ready and silent > cfg.bootstrap_timeout and conn.idle:
                    del self._conns[endpoint]
                    self._stats["restarts"] += conn.restarts_seen
                    conn.close()
                elif not conn.ready and now - conn.hello_sent_at > cfg.peer_timeout:
                    conn.say_hello()  # a safety net: restarts are noticed through Pong/Unknown
            await anyio.sleep(cfg.heartbeat_interval)
