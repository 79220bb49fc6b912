"""One prefill room: a request's KV hand-off from registration to a terminal state."""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import numpy as np
import numpy.typing as npt

from actors.serving.kv._bootstrap import bootstrap_info
from actors.serving.kv._checksum import page_checksums
from actors.serving.kv._nixl import DlistHandle, NixlError, XferHandle, XferState
from actors.serving.kv._pool import PageAllocation, as_page_array
from actors.serving.kv._transfer import (
    TransferAborted,
    coalesce,
    count_runs,
    split,
    split_pieces,
)
from protocols.engine import BootstrapInfo
from protocols.errors import KVTransferError, RequestError
from protocols.kv import KVMemoryDesc, TransferNotification, Writing, encode_notification

if TYPE_CHECKING:
    from actors.serving.kv._group import SharedWrite
    from actors.serving.kv._prefill import PrefillKV

__all__ = [
    "DecodeCancelled",
    "PrefillPeer",
    "PrefillRoom",
    "RoomState",
    "TransferRequestRecord",
    "TransferResult",
]


class DecodeCancelled(TransferAborted):
    """The decode side gave up on the room (its request was cancelled or timed out)."""

    code = "kv.decode_cancelled"


class RoomState(enum.Enum):
    OPEN = "open"  # registered; decode's page list not here yet
    REQUESTED = "requested"  # decode's page list is here
    TRANSFERRING = "transferring"  # the WRITE is posted
    DONE = "done"  # the WRITE completed; decode has been notified by NIXL
    FAILED = "failed"  # ended without (complete) KV; nothing more will be written


@dataclass(eq=False, slots=True, kw_only=True)
class PrefillPeer:
    """A decode worker as its prefill peer knows it."""

    routing_id: bytes
    worker_id: str
    agent_name: str
    incarnation: int
    memory: KVMemoryDesc
    last_seen: float
    rooms: set[int] = field(default_factory=set)
    inflight: int = 0
    dead: bool = False
    dlist: DlistHandle | None = None  # its pool's pages, prepared once


@dataclass(frozen=True, slots=True)
class TransferRequestRecord:
    """Decode's page list for a room, as received."""

    peer: PrefillPeer
    room: int
    pages: npt.NDArray[np.int64]
    want_checksums: bool
    received_at: float


@dataclass(frozen=True, slots=True)
class TransferResult:
    """What one room's transfer moved."""

    room: int
    pages: int
    nbytes: int
    descriptors: int
    seconds: float  # the WRITE, from posting to NIXL's DONE (KV and notification delivered)


_Posted = tuple[Callable[[], tuple[XferHandle, XferState]], float, int, int]
"""A posted WRITE as :func:`write_pages` takes it over: its ``start``, when it was posted, and
its bytes and descriptors."""


class PrefillRoom:
    """One request's KV hand-off; a context manager that closes (and so aborts) the room."""

    def __init__(self, kv: PrefillKV, room: int) -> None:
        self._kv = kv
        self.room = room
        self.bootstrap: BootstrapInfo = bootstrap_info(kv.endpoint, room)
        self.state = RoomState.OPEN
        self.request: TransferRequestRecord | None = None
        self.failure: RequestError | None = None
        self._wake = anyio.Event()  # the request arrived, or the room failed
        self._abort = anyio.Event()  # stop the WRITE in flight
        self._tell_decode = True
        self._close_requested = False
        # What send() gave, until the WRITE is posted; then how write_pages takes it over.
        self._ready: tuple[npt.NDArray[np.int64], npt.NDArray[np.uint64] | None, bytes] | None
        self._ready = None
        self._posted: _Posted | None = None
        self._post_error: ValueError | None = None
        self._count: int | None = None  # the pages posted (send's or post's)
        self.group: SharedWrite | None = None  # the WRITE it shares with other rooms, if any

    async def wait_requested(self, timeout: float | None = None) -> None:
        """Wait until decode sent its page list; raises the room's failure or ``TimeoutError``."""
        with anyio.fail_after(timeout):
            while self.request is None and self.failure is None:
                await self._wake.wait()
        if self.failure is not None:
            raise self.failure

    def stage(
        self,
        pages: PageAllocation | npt.NDArray[np.int64] | list[int],
        *,
        checksums: npt.NDArray[np.uint64] | None = None,
        aux: bytes = b"",
    ) -> bool:
        """Hand the room its pages without posting them: a caller that posts several rooms as
        one WRITE (``post_together``), then awaits each one's :meth:`send` with no pages.
        ``False`` if the room failed already (:meth:`send` raises that)."""
        if self.state == RoomState.FAILED and self.failure is not None:
            return False
        if self.state not in (RoomState.OPEN, RoomState.REQUESTED) or self._ready is not None:
            raise RuntimeError(f"room {self.room} cannot send in state {self.state.value}")
        local = as_page_array(pages)
        self._count = int(local.size)
        self._ready = (local, checksums, aux)
        return True

    async def send(
        self,
        pages: PageAllocation | npt.NDArray[np.int64] | list[int] | None = None,
        *,
        checksums: npt.NDArray[np.uint64] | None = None,
        aux: bytes = b"",
    ) -> TransferResult:
        """WRITE ``pages`` (computed KV in the prefill pool) into decode's pages and notify
        (``pages`` ``None``: those given to :meth:`stage` before).

        Waits up to ``bootstrap_timeout`` for decode's page list first. ``checksums`` are the
        pages' checksums if the engine has them; otherwise they are computed here when decode
        asked for them. ``aux`` (small, engine-defined: e.g. the first token) rides in the
        room's notification and reaches decode as :attr:`ReceivedKV.aux`. A GPU engine must have
        finished writing the pages (stream synchronised).

        Returns, or raises (:class:`~protocols.errors.KVTransferError` and subclasses, or
        cancellation), only once the WRITE is terminal: the pages may be freed right after.
        """
        if self.state == RoomState.FAILED and self.failure is not None:
            raise self.failure  # aborted before the KV was ready: decode cancelled, peer lost
        staged = pages is not None and self.stage(pages, checksums=checksums, aux=aux)
        if staged and self.request is not None:
            self._post()  # decode's page list is here: the WRITE goes out now
        count = self._count
        if count is None:
            raise RuntimeError(f"room {self.room}: send() without pages, and none posted")
        kv = self._kv
        try:
            with anyio.fail_after(kv.config.bootstrap_timeout):
                while self._posted is None and self.failure is None:
                    await self._wake.wait()
        except TimeoutError:
            self._fail(KVTransferError(f"decode never asked for room {self.room}"))
        except BaseException:
            # Cancelled: nothing is posted once send() has left, and a WRITE posted meanwhile
            # is stopped and settled before the caller may free the pages.
            self._ready = None
            if self._posted is not None:
                self._abort.set()  # unless it is done already: then the room is done
                with anyio.CancelScope(shield=True), contextlib.suppress(KVTransferError):
                    await self._write(self._posted, count)
            raise
        self._ready = None
        if self._posted is None:
            assert self.failure is not None
            if self._post_error is not None:
                raise self.failure from self._post_error
            raise self.failure
        return await self._write(self._posted, count)

    async def _write(self, posted: _Posted, pages: int) -> TransferResult:
        """Poll the posted WRITE to its end and settle the room (write_pages returns only once
        the WRITE is terminal, on every path)."""
        kv, req = self._kv, self.request
        assert req is not None
        post, started, nbytes, ndescs = posted
        try:
            if self.group is not None:
                seconds = await self.group.wait()
            else:
                seconds = await kv._write_pages(post, req.peer.agent_name, self._abort, started)
        except BaseException as exc:
            if self.failure is None:
                self.failure = (
                    exc
                    if isinstance(exc, KVTransferError)
                    else TransferAborted(f"prefill stopped sending room {self.room}")
                )
            self.state = RoomState.FAILED
            kv._transfer_ended(req.peer)
            kv._room_failed(self, self._tell_decode)
            if isinstance(exc, KVTransferError) and exc is not self.failure:
                raise self.failure from exc
            raise
        self.state = RoomState.DONE
        kv._transfer_ended(req.peer)
        # A WRITE shared by several rooms is counted once in the service's WRITE time.
        counted = seconds if self.group is None or self.group.count_time() else 0.0
        kv._room_done(self, nbytes, ndescs, counted)
        return TransferResult(
            room=self.room, pages=pages, nbytes=nbytes, descriptors=ndescs, seconds=seconds
        )

    def _post(self) -> None:
        """Post the WRITE now: :meth:`send` has the pages and decode's page list is here. Called
        where the page list arrives (the service's frame handler), so that a burst of requests
        (a drain's live migrations) has its WRITEs posted back to back, not each once its
        sender's task gets its turn; :meth:`send` then polls it to its end."""
        kv, req, ready = self._kv, self.request, self._ready
        assert req is not None and ready is not None and self.state == RoomState.REQUESTED
        try:
            start_write, nbytes, ndescs = plan_write(kv, ready[0], req.pages, req.peer)
        except ValueError as exc:
            self.reject(exc)
            return
        notif = encode_notification(self.notification())
        self.state = RoomState.TRANSFERRING
        kv._transfer_started(req.peer)
        kv._send(req.peer.routing_id, Writing(room=self.room))
        take, started = post_write(start_write, notif)
        self._posted = (take, started, nbytes, ndescs)
        self._wake.set()

    def notification(self) -> TransferNotification:
        """What decode hears with the staged pages (their checksums, if it asked for them);
        the pages are the WRITE's from here on."""
        assert self.request is not None and self._ready is not None
        local, checksums, aux = self._ready
        self._ready = None
        sums = b""
        if self.request.want_checksums:
            if checksums is None:
                checksums = page_checksums(self._kv.pool, local)
            sums = np.ascontiguousarray(checksums, dtype="<u8").tobytes()
        return TransferNotification(self.room, sums, aux)

    def reject(self, exc: ValueError) -> None:
        """Fail the room before its WRITE: its pages do not fit decode's."""
        self._ready = None
        self._post_error = exc
        self._fail(KVTransferError(f"room {self.room}: {exc}"))

    def abort(self, reason: str = "prefill aborted the request") -> None:
        """The engine gives up on the request: decode is told, a WRITE in flight is stopped."""
        self._fail(TransferAborted(reason))

    def close(self) -> None:
        """Unregister the room, aborting it unless it is done (idempotent).

        A WRITE still in flight is aborted and the room leaves the registry once it settled,
        so :meth:`PrefillKV.wait_transfers_done` still waits for it.
        """
        self._close_requested = True
        if self.state not in (RoomState.DONE, RoomState.FAILED):
            self._fail(TransferAborted(f"room {self.room} closed before its transfer"))
        if self.state != RoomState.TRANSFERRING:
            self._kv._unregister(self)

    def __enter__(self) -> PrefillRoom:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- driven by PrefillKV ------------------------------------------------------------------

    def _attach(self, req: TransferRequestRecord) -> None:
        self.request = req
        if self.state == RoomState.OPEN:
            self.state = RoomState.REQUESTED
        if self._ready is not None and self.failure is None:
            self._post()  # send() is waiting for this page list: the WRITE goes out now
        self._wake.set()

    def _fail(self, failure: RequestError, *, tell_decode: bool = True) -> None:
        """Fail the room. Decode hears of it now, or, for a WRITE in flight, once that WRITE
        settled: only then may decode reuse the pages."""
        if self.state in (RoomState.DONE, RoomState.FAILED):
            return
        if self.failure is None:
            self.failure = failure
        self._tell_decode = self._tell_decode and tell_decode
        self._wake.set()
        if self.state == RoomState.TRANSFERRING:
            self._abort.set()
            return
        self.state = RoomState.FAILED
        self._kv._room_failed(self, self._tell_decode)


Start = Callable[[bytes], tuple[XferHandle, XferState]]
"""``start(notif)``: post a planned WRITE with its notification."""


def post_write(
    start: Start, notif: bytes
) -> tuple[Callable[[], tuple[XferHandle, XferState]], float]:
    """Post a planned WRITE now: how :func:`write_pages` takes it over (its handle, or the
    posting's error, which fails the rooms there), and when it was posted."""
    started = time.perf_counter()
    try:
        posted: tuple[XferHandle, XferState] | NixlError = start(notif)
    except NixlError as exc:
        posted = exc

    def take() -> tuple[XferHandle, XferState]:
        if isinstance(posted, NixlError):
            raise posted
        return posted

    return take, started


def plan_write(
    kv: PrefillKV,
    local: npt.NDArray[np.int64],
    remote: npt.NDArray[np.int64],
    peer: PrefillPeer,
) -> tuple[Start, int, int]:
    """How to post a WRITE of ``local`` pages into ``peer``'s ``remote`` pages: from the
    prepared page lists (page indices; NIXL merges consecutive pages), or from freshly
    coalesced descriptors, cut into pieces when the agent's posting threads need more
    descriptors than the runs give. Returns its ``start``, bytes and descriptors; raises
    ``ValueError`` for page lists that do not fit."""
    mine, theirs = kv.pool.memory_desc(), peer.memory
    if local.size != remote.size:
        raise ValueError(f"{local.size} pages for {remote.size} decode pages")
    if mine.page_bytes != theirs.page_bytes:
        raise ValueError("local and remote page sizes differ")
    if local.size == 0 or int(local.min()) < 0 or int(local.max()) >= mine.num_pages:
        raise ValueError("page index out of the prefill pool's range")
    nbytes = int(local.size) * mine.page_bytes
    local_list = kv._links.local if kv._links is not None else None
    agent, remote_list = kv.agent, peer.dlist
    runs = count_runs(local, remote)
    pieces = split_pieces(nbytes, agent.num_threads, kv.config.split_min_bytes)
    if local_list is not None and remote_list is not None and runs >= pieces:
        lidx = local.astype(np.int32)
        ridx = remote.astype(np.int32)

        def start_prepped(notif: bytes) -> tuple[XferHandle, XferState]:
            return agent.post_prepped(local_list, lidx, remote_list, ridx, notif)

        return start_prepped, nbytes, runs
    # Too few runs for the agent's posting threads: cut them (prepared lists are per page).
    descs = split(coalesce(local, mine, remote, theirs), pieces)

    def start_raw(notif: bytes) -> tuple[XferHandle, XferState]:
        return agent.post(
            "WRITE",
            descs.local,
            mine.mem_type,
            descs.remote,
            theirs.mem_type,
            peer.agent_name,
            notif,
        )

    return start_raw, nbytes, descs.count
