"""Our own KV transfer for engines that do not move KV themselves (the mock, the hf engine).

One NIXL side per worker (:class:`KVBridge`): a :class:`~actors.serving.kv.KVPool` registered once,
and a :class:`~actors.serving.kv.PrefillKV` (prefill workers) or
:class:`~actors.serving.kv.DecodeKV` (decode workers) over it. How an engine's KV meets that pool is
the engine's :class:`EngineTransfer`:

- the mock (:class:`MockTransfer`) registers its own KV buffer: on prefill its pages are WRITTEN
  straight into the decode engine's pages (sent as decode's page list) and only then released,
  never freed while decode reads; on decode the engine allocates the prompt's pages, the bridge
  receives them, and the engine verifies every page against the tokens before it decodes
  (``KVCorrupted`` otherwise) and recomputes the first token itself;
- the hf engine (:class:`~actors.serving.worker._kvbridge_hf.HFTransfer`) computes the prompt's KV
  into pages of a staging pool in its page layout, and its first token travels with the transfer.

In both, a request's room is opened *before* its first output is published, and the prefill
stream ends only once the transfer reached a terminal state. Engines with their own transfer
(SGLang's NIXL connector) never get a bridge.

Live migration (a drain): a decode worker whose transfer can :class:`HandOver` also runs a
:class:`~actors.serving.kv.PrefillKV` over its own pages, under a second NIXL agent (one agent
cannot be both a decode peer and a prefill peer of the same worker: each side loads and drops its
peers' agents on its own, and prefill's housekeeping would take decode's notifications). On a drain,
:meth:`KVBridge.hand_over` opens a room for each decoding request and offers it on the request's
stream at once, then stops them all at the engine's next step boundary and sends each room its
pages; the next decode worker receives the KV through its ordinary decode path (asked for while the
draining engine's last step still runs), so the transfer, the page ownership rules and the
verification are the prefill -> decode ones."""

from __future__ import annotations

import contextlib
import os
import re
import struct
import tempfile
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import anyio
import anyio.abc
import anyio.lowlevel
import msgspec
import structlog

from actors.serving.engines import FAKE_BOOTSTRAP_HOST, Offer
from protocols.engine import BootstrapInfo, Capacity, EngineOutput, PreprocessedRequest
from protocols.errors import KVTransferError, RequestError

if (
    TYPE_CHECKING
):  # actors.serving.kv is imported where a bridge opens: only bridged workers need NIXL
    from actors.serving.kv import KVPool, PageAllocation, PrefillKV, PrefillRoom, ReceivedKV
    from actors.serving.worker._faults import InjectedFaults

__all__ = ["EngineTransfer", "HandOver", "KVBridge", "MockTransfer", "Receive", "needs_transfer"]

_log = structlog.get_logger("actorserve.kv")


def needs_transfer(request: PreprocessedRequest) -> bool:
    """Whether ``request`` is half of a disaggregated pair (a real bootstrap triple)."""
    info = request.bootstrap_info
    return info is not None and info.host != FAKE_BOOTSTRAP_HOST


Receive = Callable[["PageAllocation", bool], Awaitable["ReceivedKV"]]
"""``receive(pages, verify)``: the request's room into ``pages`` of the bridge's pool (see
:meth:`actors.serving.kv.DecodeKV.receive`: on any error the pages pass to the transfer service)."""


class EngineTransfer(Protocol):
    """What the bridge needs from an engine: the memory NIXL moves, and both halves of a
    hand-off. The bridge owns the NIXL side (agent, bootstrap endpoint, rooms)."""

    def pool(self) -> KVPool:
        """The pages NIXL reads and writes (called once per bridge; the bridge closes it)."""
        ...

    def prefill(
        self, request: PreprocessedRequest, room: PrefillRoom
    ) -> AsyncGenerator[EngineOutput, None]:
        """Run the prompt, publish its output, then ``room.send`` its pages; end once the send
        returned (the room is terminal: the pages may be reused)."""
        ...

    def decode(
        self, request: PreprocessedRequest, receive: Receive
    ) -> AsyncGenerator[EngineOutput, None]:
        """Take the prompt's KV through ``receive`` and stream the whole generation, starting
        with its first token."""
        ...


@runtime_checkable
class HandOver(Protocol):
    """What a decode engine's transfer adds for live migration."""

    def source_pool(self) -> KVPool:
        """The pages of :meth:`EngineTransfer.pool` again, for the hand-over side's own agent."""
        ...

    async def hand_over(
        self, rids: Sequence[str], offer: Offer
    ) -> dict[str, tuple[list[int], bytes] | None]:
        """Stop decoding ``rids`` (at the engine's next step boundary, all together) and hold
        their KV: each one's pages (every token but the newest) and what the room's
        notification carries with them to the next engine (``aux``), or ``None`` when it
        cannot be handed over (it is not decoding); a request that ended meanwhile is left
        out. Before the boundary, ``offer`` is called with how many tokens each one's KV will
        cover, and each request it answers a room for has that offer published on its stream
        (``disaggregated_params``, ``handover_tokens``)."""
        ...

    def release(self, rid: str) -> None:
        """The hand-over of ``rid`` is terminal (sent or given up): free its pages."""
        ...


class KVBridge:
    """One worker's NIXL side: a PrefillKV or DecodeKV over its engine's transfer pool (plus,
    on a decode worker that can hand over, a PrefillKV for live migration)."""

    def __init__(self, transfer: EngineTransfer, role: str, worker_id: str) -> None:
        self.role = role
        self.worker_id = worker_id
        self.transfer = transfer
        self._stack = contextlib.AsyncExitStack()
        self.service: Any = None
        self.pool: KVPool | None = None
        self.endpoint: str | None = None
        self.source: PrefillKV | None = None  # decode: where a drain's KV is read from
        self._senders: anyio.abc.TaskGroup | None = None
        self._handovers: dict[str, PrefillRoom] = {}

    async def __aenter__(self) -> KVBridge:
        from actors.serving.kv import DecodeKV, KVConfig, NixlAgent, PrefillKV

        pool = self.pool = self.transfer.pool()
        # Only a sending agent posts WRITEs: it alone gets posting threads.
        threads = KVConfig().agent_threads(pool.mem_type) if self.role == "prefill" else 0
        agent = NixlAgent(f"{self.role}-{self.worker_id}-{os.getpid()}", num_threads=threads)
        self._stack.callback(agent.close)
        self._stack.callback(pool.close)  # LIFO: deregistered while the agent is still open
        if self.role == "prefill":
            path = self._endpoint("kv")
            self.service = await self._stack.enter_async_context(
                PrefillKV(agent, pool, endpoint=path, worker_id=self.worker_id)
            )
            self.endpoint = self.service.endpoint
        else:
            self.service = await self._stack.enter_async_context(
                DecodeKV(agent, pool, worker_id=self.worker_id)
            )
            if isinstance(self.transfer, HandOver):
                await self._open_source(self.transfer)
        return self

    async def _open_source(self, transfer: HandOver) -> None:
        from actors.serving.kv import KVConfig, NixlAgent, PrefillKV

        pool = transfer.source_pool()
        threads = KVConfig().agent_threads(pool.mem_type)
        agent = NixlAgent(f"handover-{self.worker_id}-{os.getpid()}", num_threads=threads)
        self._stack.callback(agent.close)
        self._stack.callback(pool.close)
        path = self._endpoint("kvh")
        self.source = await self._stack.enter_async_context(
            PrefillKV(agent, pool, endpoint=path, worker_id=self.worker_id)
        )
        self.endpoint = self.source.endpoint
        # LIFO: on exit the senders are cancelled (each settles its room and frees its pages)
        # while the source service is still open.
        self._senders = await self._stack.enter_async_context(anyio.create_task_group())
        self._stack.callback(self._senders.cancel_scope.cancel)

    def _endpoint(self, kind: str) -> str:
        # In a worker process the temporary directory is the process's own (removed with it).
        # A worker id carries its model's name, which may hold a "/" and be long: a path needs
        # neither (a socket path holds at most 107 bytes).
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", self.worker_id)[-32:]
        return f"ipc://{tempfile.gettempdir()}/actorserve-{kind}-{os.getpid()}-{safe}.sock"

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    def capacity(self, capacity: Capacity) -> Capacity:
        """The engine's capacity, with the bootstrap endpoint decode peers must meet."""
        if self.endpoint is None:
            return capacity
        from actors.serving.kv import bootstrap_info

        return msgspec.structs.replace(capacity, bootstrap=bootstrap_info(self.endpoint, 0))

    def transfer_pages(self) -> int:
        """Pages the bridge holds for transfers now (received, quarantined); 0 when idle."""
        return self.pool.statistics().pages_in_use if self.pool is not None else 0

    def write_seconds(self) -> float:
        """The WRITEs this worker's KV went out in (a prefill's, a drain's hand-overs), each
        from its posting to NIXL's DONE, summed."""
        sending = self.service if self.role == "prefill" else self.source
        if sending is None:
            return 0.0
        seconds: float = sending.statistics().write_seconds
        return seconds

    @property
    def handovers_open(self) -> int:
        return len(self._handovers)

    async def hand_over(self, rids: Sequence[str]) -> dict[str, BootstrapInfo | None]:
        """Decode, a drain: stop decoding ``rids`` and offer each one's KV in a fresh room of
        the source endpoint (its triple is the next decode worker's ``bootstrap_info``).

        The rooms are opened, and offered on the requests' streams, at once: the next worker
        can admit each request and send its page list while the engine's step in flight still
        runs. The engine lets go of them all at that step's boundary; nothing is awaited after
        it, so the WRITEs whose page lists are here are posted before any other task runs (the
        streams' last outputs among them), and the caller has the offers before any of their
        streams can see its end.
        ``None`` for a request that cannot be handed over (abort it for a replay; every one
        on a worker that cannot hand over); a request that ended meanwhile is left out (its
        room aborted)."""
        transfer, source, senders = self.transfer, self.source, self._senders
        if source is None or senders is None or not isinstance(transfer, HandOver):
            return dict.fromkeys(rids)
        rooms: dict[str, PrefillRoom] = {}

        def offer(planned: dict[str, int]) -> dict[str, BootstrapInfo]:
            for rid in planned:
                rooms[rid] = self._handovers[rid] = source.open_room()
            return {rid: room.bootstrap for rid, room in rooms.items()}

        held: dict[str, tuple[list[int], bytes] | None] = {}
        try:
            held = await transfer.hand_over(rids, offer)
        finally:
            for rid, opened in rooms.items():
                if held.get(rid) is None:
                    # Offered, not handed over: it ended at the boundary (or the hand-over
                    # failed). The worker that was getting ready for it hears so now.
                    opened.abort(f"{rid}: not handed over")
                    opened.close()
                    del self._handovers[rid]
        from actors.serving.kv import post_together

        offers: dict[str, BootstrapInfo | None] = {}
        handed: list[tuple[PrefillRoom, list[int], bytes]] = []
        for rid, pages in held.items():
            room = rooms.get(rid)
            if pages is None or room is None:
                offers[rid] = None
            else:
                handed.append((room, *pages))
                senders.start_soon(self._send, rid, room, name=f"hand over {rid}")
                offers[rid] = room.bootstrap
        # Posted here, before any other task runs (the streams' last outputs among them): the
        # rooms whose page lists are here as one WRITE to each next worker.
        post_together(handed)
        return offers

    def abort_handover(self, rid: str) -> bool:
        """Give up the hand-over of ``rid`` (its request went elsewhere): ``False`` if there is
        none. The pages are freed once the room is terminal, never while a WRITE reads them."""
        room = self._handovers.get(rid)
        if room is None:
            return False
        room.abort(f"{rid}: the request continues elsewhere")
        return True

    async def _send(self, rid: str, room: PrefillRoom) -> None:
        assert isinstance(self.transfer, HandOver)
        try:
            with room:
                await room.send()
        except RequestError as exc:
            _log.info("live migration KV not sent", rid=rid, error=str(exc))
        finally:
            del self._handovers[rid]
            self.transfer.release(rid)

    def connect_soon(self, endpoint: str) -> None:
        """Decode: start meeting a prefill worker ahead of its first request (pre-warm)."""
        if self.role == "decode":
            self.service.connect_soon(endpoint)

    async def prefill(self, request: PreprocessedRequest) -> AsyncGenerator[EngineOutput, None]:
        """Run the prompt; then WRITE its pages to decode; the stream ends when the transfer has
        reached a terminal state."""
        assert request.bootstrap_info is not None
        with self.service.open_room(request.bootstrap_info.room) as room:
            outputs = self.transfer.prefill(request, room)
            try:
                async for output in outputs:
                    yield output
            finally:
                await outputs.aclose()

    def decode(self, request: PreprocessedRequest) -> AsyncGenerator[EngineOutput, None]:
        """Take the prompt's pages from prefill, then decode from them: the transfer's own
        stream (no generator of ours around it, which every output would pass through; the
        caller closes it)."""
        bootstrap = request.bootstrap_info
        assert bootstrap is not None
        service = self.service

        async def receive(pages: PageAllocation, verify: bool) -> ReceivedKV:
            got: ReceivedKV = await service.receive(bootstrap, pages, verify=verify)
            return got

        return self.transfer.decode(request, receive)


class MockTransfer:
    """The mock engine's transfer hooks (see ``actors.serving.engines._mock._transfer``): NIXL moves
    its own KV buffer, and decode verifies the pages against the tokens itself."""

    def __init__(self, engine: Any, faults: InjectedFaults) -> None:
        self.engine = engine
        # The host's (``hold_kv``, ``corrupt_kv``, ``fail_kv``): tests and scenarios.
        self._faults = faults
        self._pool: KVPool | None = None
        # Requests whose KV arrived in this event-loop turn, with the hash it came with.
        self._landed: dict[str, int | None] = {}

    def pool(self) -> KVPool:
        self._pool = self.source_pool()
        return self._pool

    def source_pool(self) -> KVPool:
        from actors.serving.kv import KVPool

        memory = self.engine.kv_memory(0)
        return KVPool.from_buffer(self.engine.kv_buffer(0), memory.block_bytes)

    async def hand_over(
        self, rids: Sequence[str], offer: Offer
    ) -> dict[str, tuple[list[int], bytes] | None]:
        if self.engine.config.dp_size != 1:
            return dict.fromkeys(rids)  # the bridge moves rank 0's pages only
        handed = await self.engine.hand_over(rids, offer)
        return {
            rid: None if p is None else (list(p.block_ids), _pack_prefix_hash(p.prefix_hash))
            for rid, p in handed.items()
        }

    def release(self, rid: str) -> None:
        self.engine.release_transfer(rid)

    async def prefill(
        self, request: PreprocessedRequest, room: PrefillRoom
    ) -> AsyncGenerator[EngineOutput, None]:
        engine, rid = self.engine, request.rid
        outputs = engine.generate(request)
        # Once its last output is out the engine owes the KV (its stream is done, so closing it
        # frees nothing): every way out of here, a close or cancellation at any await included,
        # must free it, or it stays held until the engine's own transfer timeout (minutes).
        try:
            try:
                async for output in outputs:
                    yield output
            finally:
                await outputs.aclose()
            source = await engine.wait_transfer_source(rid)
            faults = self._faults
            if faults.armed and faults.take("hold_kv"):
                # A prefill that hangs mid-handshake: decode waits for KV that never comes.
                await anyio.sleep_forever()
            await room.send(list(source.block_ids))
        finally:
            engine.release_transfer(rid)

    async def _complete(self, rid: str, prefix_hash: int | None) -> None:
        """Have the engine go on decoding ``rid``, together with every request whose KV lands
        in the same event-loop turn (a drain's live migrations), their pages verified in one
        pass while their first step runs (``complete_transfers(overlap=True)``). The first to
        land waits out that turn, shielded (its own cancellation must not strand the others),
        and completes them all; a request whose pages fail ends its stream with
        ``KVCorrupted`` before that step's tokens."""
        landed = self._landed
        landed[rid] = prefix_hash
        if len(landed) > 1:
            return  # the first one's turn completes it
        with anyio.CancelScope(shield=True):
            await anyio.lowlevel.checkpoint()
        self._landed = {}
        hashes = {r: h for r, h in landed.items() if h is not None}
        try:
            self.engine.complete_transfers(list(landed), overlap=True, prefix_hashes=hashes)
        except Exception as exc:
            for other in landed:
                self.engine.fail_transfer(other, f"{type(exc).__name__}: {exc}")
            raise

    async def decode(
        self, request: PreprocessedRequest, receive: Receive
    ) -> AsyncGenerator[EngineOutput, None]:
        assert self._pool is not None
        engine, rid = self.engine, request.rid
        outputs = engine.generate(request)
        try:
            target = await engine.wait_transfer_target(rid)
            pages = self._pool.alloc_exact(target.block_ids)
            try:
                # The engine verifies the pages itself (complete_transfer): no checksums needed.
                got = await receive(pages, False)
            except BaseException as exc:
                if not pages.freed:
                    # The transfer service holds the pages until no WRITE can reach them any
                    # more: the engine must not hand them to another request before.
                    pages.on_free(engine.hold_blocks(target))
                if isinstance(exc, KVTransferError):
                    engine.fail_transfer(rid, str(exc))
                elif isinstance(exc, Exception):
                    engine.fail_transfer(rid, f"{type(exc).__name__}: {exc}")
                    raise KVTransferError(f"{type(exc).__name__}: {exc}") from exc
                raise
            pages.free()
            try:
                prefix_hash = _unpack_prefix_hash(got.aux)
            except KVTransferError as exc:
                engine.fail_transfer(rid, str(exc))
                raise
            faults = self._faults
            if faults.armed:
                if faults.take("fail_kv"):
                    # The transfer fails, as a lost NIXL connection would.
                    engine.fail_transfer(rid, "injected KV transfer failure")
                    raise KVTransferError("injected KV transfer failure")
                if faults.take("corrupt_kv"):
                    # One flipped byte in the first received page.
                    buffer = engine.kv_buffer(target.dp_rank)
                    buffer[target.block_ids[0], 0] ^= 0xFF
            await self._complete(rid, prefix_hash)
            async for output in outputs:
                yield output
        finally:
            await outputs.aclose()


# A hand-over's pages carry the token model's hash of their tokens (KvPages.prefix_hash) to
# the next engine in their room's notification.
_PREFIX_HASH = struct.Struct("<Q")


def _pack_prefix_hash(prefix_hash: int | None) -> bytes:
    return b"" if prefix_hash is None else _PREFIX_HASH.pack(prefix_hash)


def _unpack_prefix_hash(aux: bytes) -> int | None:
    if not aux:
        return None  # a prefill's KV: the engine hashes the tokens itself
    if len(aux) != _PREFIX_HASH.size:
        size = _PREFIX_HASH.size
        raise KVTransferError(f"the KV came with {len(aux)} bytes of state, not {size}")
    value: int = _PREFIX_HASH.unpack(aux)[0]
    return value
