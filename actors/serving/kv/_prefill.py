"""The prefill side: a bootstrap endpoint, the rooms a prefill worker owes, and their WRITEs.

Ownership rules (the use-after-free that Dynamo hit, issues #7319/#9344, is the reason):

- a room is registered (:meth:`PrefillKV.open_room`) *before* its bootstrap triple is published;
- :meth:`PrefillRoom.send` returns, on every path (success, error, abort, cancellation), only once
  the WRITE reached a terminal state, so the engine may free its pages right after;
- :meth:`PrefillKV.wait_transfers_done` is the bounded drain a shutdown runs before the engine
  frees its memory.

A decode peer that goes silent for ``peer_timeout`` (SIGKILL, hang) is dropped: its rooms are
aborted, their WRITEs settled, and its remote agent removed. A decode peer that says ``Hello``
again with another incarnation (restarted on the same worker id, maybe under the same agent name)
replaces the stale one the same way before its metadata is loaded.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import anyio.abc
import msgspec
import zmq

from actors.lowlevel import AsyncSocket
from actors.serving.kv._bootstrap import KVConfig, check_room, new_room, unpack_pages
from actors.serving.kv._channel import Channel
from actors.serving.kv._link import PeerLinks
from actors.serving.kv._nixl import NixlAgent, NixlError, XferHandle, XferState
from actors.serving.kv._pool import KVPool
from actors.serving.kv._room import DecodeCancelled, PrefillPeer, PrefillRoom, TransferRequestRecord
from actors.serving.kv._transfer import TransferAborted, write_pages
from protocols.errors import KVTransferError
from protocols.kv import (
    BootstrapMessage,
    CancelRoom,
    Goodbye,
    Hello,
    Ping,
    Pong,
    Reject,
    RoomClosed,
    RoomFailed,
    TransferRequest,
    UnknownPeer,
    Welcome,
    decode_message,
    encode_message,
)

__all__ = ["PrefillKV", "PrefillStatistics"]

_CLOSED_MEMORY = 4096  # recently closed rooms, answered at once when their request comes late


@dataclass(frozen=True, slots=True)
class PrefillStatistics:
    """A prefill KV service's rooms, peers and traffic."""

    endpoint: str
    peers: int
    open_rooms: int
    requested_rooms: int
    transfers_in_flight: int
    early_requests: int
    rooms_done: int
    rooms_failed: int
    bytes_sent: int
    descriptors_sent: int
    peers_lost: int
    peers_replaced: int
    write_seconds: float  # the WRITEs done, each from its posting to NIXL's DONE, summed


class PrefillKV:
    """The prefill worker's KV service: bootstrap endpoint, rooms, peers, WRITEs.

    Use ``async with PrefillKV(agent, pool) as kv:``; the pool is registered with ``agent`` on
    entry if it is not yet. ``endpoint`` is a ZMQ bind address (``tcp://127.0.0.1:0`` picks a
    port; ``ipc://path`` works too); :attr:`endpoint` is the resolved one.
    """

    def __init__(
        self,
        agent: NixlAgent,
        pool: KVPool,
        *,
        endpoint: str = "tcp://127.0.0.1:0",
        worker_id: str | None = None,
        config: KVConfig | None = None,
    ) -> None:
        self.agent = agent
        self.pool = pool
        self.config = config or KVConfig()
        self.worker_id = worker_id or agent.name
        self._bind = endpoint
        self.endpoint = endpoint
        self._chan: Channel | None = None
        self._links: PeerLinks | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._rooms: dict[int, PrefillRoom] = {}
        self._early: dict[int, TransferRequestRecord] = {}
        self._closed_rooms: OrderedDict[int, tuple[str, str]] = OrderedDict()
        self._peers: dict[bytes, PrefillPeer] = {}
        self._dying: list[PrefillPeer] = []  # dropped, WRITEs still settling
        self._greeting: set[tuple[str, int]] = set()  # Hellos being handled (agent, incarnation)
        self._inflight = 0
        self._changed: anyio.Event | None = None
        self._stats = {"done": 0, "failed": 0, "bytes": 0, "descs": 0, "lost": 0, "replaced": 0}
        self._write_s = 0.0

    async def __aenter__(self) -> PrefillKV:
        self._changed = anyio.Event()
        self.pool.register(self.agent)
        self._links = PeerLinks(self.agent, self.pool, prepare=self.config.prepared_dlists)
        sock = AsyncSocket.create(zmq.ROUTER, ROUTER_HANDOVER=1, SNDHWM=0, RCVHWM=0)
        try:
            self.endpoint = sock.bind(self._bind)
            self._tg = anyio.create_task_group()
            await self._tg.__aenter__()
        except BaseException:
            sock.close()
            raise
        self._chan = Channel(sock, self._on_frames)
        self._tg.start_soon(self._serve)
        self._tg.start_soon(self._housekeeping)
        return self

    async def __aexit__(self, *exc: object) -> None:
        # Abort what is still open; WRITEs in flight settle before anything is torn down.
        for room in list(self._rooms.values()):
            room._fail(TransferAborted("prefill KV service stopped"))
        with anyio.CancelScope(shield=True), anyio.move_on_after(self.config.settle_timeout):
            while self._inflight:
                await self._wait_changed()
        self._rooms.clear()
        self._early.clear()
        assert self._tg is not None and self._chan is not None
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(None, None, None)
        for peer in [*self._peers.values(), *self._dying]:
            self._forget(peer)
        self._dying.clear()
        self._chan.close()
        if self._links is not None:
            self._links.close()

    # -- public API ---------------------------------------------------------------------------

    def open_room(self, room: int | None = None) -> PrefillRoom:
        """Register a room (a fresh random one by default) before publishing its bootstrap info."""
        room = check_room(new_room() if room is None else room)
        if room in self._rooms:
            raise ValueError(f"room {room} is already open")
        handle = PrefillRoom(self, room)
        self._rooms[room] = handle
        self._closed_rooms.pop(room, None)
        early = self._early.pop(room, None)
        if early is not None:
            handle._attach(early)
        return handle

    async def wait_transfers_done(self, timeout: float | None = None) -> bool:
        """Wait until every open room reached a terminal state and was closed (bounded drain).

        Returns ``False`` if rooms are still open after ``timeout``.
        """
        with anyio.move_on_after(timeout):
            while self._rooms:
                await self._wait_changed()
        return not self._rooms

    def is_quiescent(self) -> bool:
        """No room is open: nothing is owed to any decode worker."""
        return not self._rooms

    def statistics(self) -> PrefillStatistics:
        s = self._stats
        return PrefillStatistics(
            endpoint=self.endpoint,
            peers=len(self._peers),
            open_rooms=len(self._rooms),
            requested_rooms=sum(1 for r in self._rooms.values() if r.request is not None),
            transfers_in_flight=self._inflight,
            early_requests=len(self._early),
            rooms_done=s["done"],
            rooms_failed=s["failed"],
            bytes_sent=s["bytes"],
            descriptors_sent=s["descs"],
            peers_lost=s["lost"],
            peers_replaced=s["replaced"],
            write_seconds=self._write_s,
        )

    async def _write_pages(
        self,
        start: Callable[[], tuple[XferHandle, XferState]],
        remote: str,
        abort: anyio.Event,
        started: float,
    ) -> float:
        """:func:`write_pages` (a room's WRITE, or one shared by rooms) with this service's
        timeouts and polling."""
        cfg = self.config
        return await write_pages(
            self.agent,
            start,
            remote,
            timeout=cfg.transfer_timeout,
            abort=abort,
            spin_s=cfg.spin_s,
            yields=cfg.yields,
            settle_timeout=cfg.settle_timeout,
            started=started,
        )

    # -- the channel ----------------------------------------------------------------------------

    def _send(self, routing_id: bytes, msg: BootstrapMessage) -> None:
        if self._chan is not None:
            # ROUTER drops a message for a peer that is gone, which is what we want.
            self._chan.send([routing_id, encode_message(msg)])

    async def _serve(self) -> None:
        assert self._chan is not None
        await self._chan.run()

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            return
        rid, payload = frames
        try:
            msg = decode_message(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        peer = self._peers.get(rid)
        if peer is not None:
            peer.last_seen = time.monotonic()
        if isinstance(msg, Hello):
            assert self._tg is not None
            self._tg.start_soon(self._hello, rid, msg)
        elif isinstance(msg, Ping):
            self._send(rid, Pong(seq=msg.seq, incarnation=self.agent.incarnation))
            if peer is None:
                self._send(rid, UnknownPeer())
        elif peer is None:
            if isinstance(msg, TransferRequest):
                self._send(rid, RoomFailed(room=msg.room, code="kv.unknown_peer", message=""))
            if isinstance(msg, CancelRoom):
                self._send(rid, RoomClosed(room=msg.room))
            if not isinstance(msg, Goodbye):
                self._send(rid, UnknownPeer())
        elif isinstance(msg, TransferRequest):
            self._request(peer, msg)
        elif isinstance(msg, CancelRoom):
            self._cancel(peer, msg.room)
        elif isinstance(msg, Goodbye):
            self._drop(peer, "decode peer left")

    async def _hello(self, rid: bytes, hello: Hello) -> None:
        key = (hello.agent_name, hello.incarnation)
        if key in self._greeting:
            return  # a repeated Hello while the first is being handled: that one answers
        self._greeting.add(key)
        try:
            await self._greet(rid, hello)
        finally:
            self._greeting.discard(key)

    async def _greet(self, rid: bytes, hello: Hello) -> None:
        if hello.memory.page_bytes != self.pool.page_bytes:
            reason = f"page size {hello.memory.page_bytes} != {self.pool.page_bytes}"
            self._send(rid, Reject(reason=reason))
            return
        for old in [*self._peers.values(), *self._dying]:
            same = old.worker_id == hello.worker_id or old.agent_name == hello.agent_name
            if same and old.incarnation == hello.incarnation and not old.dead:
                # The same decode incarnation again (it reconnected): re-route, nothing to load.
                del self._peers[old.routing_id]
                old.routing_id = rid
                self._peers[rid] = old
                self._send(rid, self._welcome())
                return
            if same:
                if old.incarnation != hello.incarnation:
                    self._stats["replaced"] += 1
                self._drop(old, "decode peer restarted")
                # Its WRITEs must settle before its remote agent may be removed and replaced.
                with anyio.move_on_after(self.config.settle_timeout):
                    while old.inflight:
                        await self._wait_changed()
                self._forget(old)
        assert self._links is not None
        try:
            dlist = await self._links.connect(
                hello.agent_metadata,
                hello.agent_name,
                hello.memory,
                timeout=self.config.settle_timeout,
            )
        except NixlError as exc:
            self._send(rid, Reject(reason=str(exc)))
            return
        self._peers[rid] = PrefillPeer(
            routing_id=rid,
            worker_id=hello.worker_id,
            agent_name=hello.agent_name,
            incarnation=hello.incarnation,
            memory=hello.memory,
            last_seen=time.monotonic(),
            dlist=dlist,
        )
        self._send(rid, self._welcome())

    def _welcome(self) -> Welcome:
        return Welcome(
            worker_id=self.worker_id,
            agent_name=self.agent.name,
            incarnation=self.agent.incarnation,
            page_bytes=self.pool.page_bytes,
        )

    def _request(self, peer: PrefillPeer, msg: TransferRequest) -> None:
        try:
            pages = unpack_pages(msg.pages)
            if pages.size == 0 or int(pages.min()) < 0 or int(pages.max()) >= peer.memory.num_pages:
                raise ValueError("page index out of the decode pool's range")
        except ValueError as exc:
            self._send(
                peer.routing_id, RoomFailed(room=msg.room, code="kv.invalid", message=str(exc))
            )
            return
        req = TransferRequestRecord(peer, msg.room, pages, msg.want_checksums, time.monotonic())
        room = self._rooms.get(msg.room)
        closed = self._closed_rooms.get(msg.room)
        if room is not None and room.request is None and room.failure is None:
            peer.rooms.add(msg.room)
            room._attach(req)
        elif room is None and closed is None and msg.room not in self._early:
            peer.rooms.add(msg.room)
            self._early[msg.room] = req
        else:
            code, message = closed or ("kv.room_taken", f"room {msg.room} is not available")
            if room is not None and room.failure is not None:
                code, message = room.failure.to_wire()
            self._send(peer.routing_id, RoomFailed(room=msg.room, code=code, message=message))

    def _cancel(self, peer: PrefillPeer, room_id: int) -> None:
        room = self._rooms.get(room_id)
        if room is not None and room.request is not None and room.request.peer is peer:
            # Decode gave up: stop, and answer RoomClosed once nothing more will be written.
            room._fail(DecodeCancelled(f"decode cancelled room {room_id}"))
        else:
            if self._early.get(room_id) is not None and self._early[room_id].peer is peer:
                del self._early[room_id]
            peer.rooms.discard(room_id)
            self._send(peer.routing_id, RoomClosed(room=room_id))

    async def _housekeeping(self) -> None:
        """Reap silent peers and stale early requests; drive UCX progress while idle."""
        cfg = self.config
        next_reap = 0.0
        while True:
            now = time.monotonic()
            if now >= next_reap:
                next_reap = now + cfg.heartbeat_interval
                for peer in list(self._peers.values()):
                    if now - peer.last_seen > cfg.peer_timeout:
                        self._stats["lost"] += 1
                        self._drop(peer, "decode peer lost (no heartbeat)")
                for room_id, req in list(self._early.items()):
                    if now - req.received_at > cfg.bootstrap_timeout:
                        del self._early[room_id]
                        req.peer.rooms.discard(room_id)
                        msg = f"prefill never opened room {room_id}"
                        self._send(
                            req.peer.routing_id,
                            RoomFailed(room=room_id, code="kv.transfer_failed", message=msg),
                        )
            self.agent.get_notifs()  # progress for UCX wire-up the peers start
            await anyio.sleep(cfg.idle_poll_s)

    # -- peers and rooms --------------------------------------------------------------------

    def _drop(self, peer: PrefillPeer, reason: str) -> None:
        """Abort every room of ``peer``; its remote agent goes once its WRITEs settled."""
        if self._peers.get(peer.routing_id) is peer:
            del self._peers[peer.routing_id]
        peer.dead = True
        for room_id in list(peer.rooms):
            self._early.pop(room_id, None)
            room = self._rooms.get(room_id)
            if room is not None and room.request is not None and room.request.peer is peer:
                room._fail(KVTransferError(reason), tell_decode=False)
        peer.rooms.clear()
        if peer.inflight:
            if peer not in self._dying:
                self._dying.append(peer)
        else:
            self._forget(peer)

    def _forget(self, peer: PrefillPeer) -> None:
        if self._peers.get(peer.routing_id) is peer:
            del self._peers[peer.routing_id]
        if self._links is not None:
            self._links.disconnect(peer.agent_name, peer.dlist)
            peer.dlist = None

    def _transfer_started(self, peer: PrefillPeer) -> None:
        peer.inflight += 1
        self._inflight += 1

    def _transfer_ended(self, peer: PrefillPeer) -> None:
        peer.inflight -= 1
        self._inflight -= 1
        if peer.dead and not peer.inflight and peer in self._dying:
            self._dying.remove(peer)
            self._forget(peer)
        self._notify()

    def _room_done(self, room: PrefillRoom, nbytes: int, descs: int, seconds: float) -> None:
        self._stats["done"] += 1
        self._stats["bytes"] += nbytes
        self._stats["descs"] += descs
        self._write_s += seconds
        if room.request is not None:
            room.request.peer.rooms.discard(room.room)
        if room._close_requested:
            self._unregister(room)

    def _room_failed(self, room: PrefillRoom, tell_decode: bool) -> None:
        self._stats["failed"] += 1
        req = room.request
        if req is not None:
            req.peer.rooms.discard(room.room)
            if tell_decode and not req.peer.dead:
                if isinstance(room.failure, DecodeCancelled):
                    self._send(req.peer.routing_id, RoomClosed(room=room.room))
                else:
                    assert room.failure is not None
                    code, message = room.failure.to_wire()
                    failed = RoomFailed(room=room.room, code=code, message=message)
                    self._send(req.peer.routing_id, failed)
        if room._close_requested:
            self._unregister(room)

    def _unregister(self, room: PrefillRoom) -> None:
        if self._rooms.get(room.room) is room:
            del self._rooms[room.room]
            code, message = room.failure.to_wire() if room.failure else ("kv.room_done", "")
            self._closed_rooms[room.room] = (code, message)
            while len(self._closed_rooms) > _CLOSED_MEMORY:
                self._closed_rooms.popitem(last=False)
        self._notify()

    async def _wait_changed(self) -> None:
        assert self._changed is not None, "use PrefillKV as an async context manager"
        await self._changed.wait()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = anyio.Event()
