"""Several rooms' KV in one WRITE: a drain's hand-overs to one decode worker.

Each room's WRITE costs the sending worker a post (descriptor lists, a NIXL request, a
``Writing`` message) and the receiving one a notification to handle; for a drain of 16
requests that is milliseconds on each side, after the step boundary, before the next worker
can start them. Rooms whose page lists came from the same peer go out together: one WRITE of
all their pages, one notification naming every room (``encode_notifications``), one
``Writing`` for all. Each room still settles on its own (done, failed), but they share the
WRITE's fate: aborting one stops the WRITE, and so fails the others too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import anyio
import numpy as np
import numpy.typing as npt

from actors.serving.kv._nixl import XferHandle, XferState
from actors.serving.kv._pool import PageAllocation
from actors.serving.kv._room import PrefillPeer, PrefillRoom, RoomState, plan_write, post_write
from actors.serving.kv._transfer import TransferAborted, count_runs
from protocols.errors import RequestError
from protocols.kv import Writing, encode_notifications

if TYPE_CHECKING:
    from actors.serving.kv._prefill import PrefillKV

__all__ = ["SharedWrite", "post_together"]

Pages = PageAllocation | npt.NDArray[np.int64] | list[int]


def post_together(items: Sequence[tuple[PrefillRoom, Pages, bytes]]) -> None:
    """Give each room its pages and ``aux`` (:meth:`PrefillRoom.stage`), posting one WRITE per
    decode peer for the rooms whose page lists are here; the others post theirs where their
    page list arrives. Each room's owner then awaits ``room.send()``."""
    ready: dict[PrefillPeer, list[PrefillRoom]] = {}
    for room, pages, aux in items:
        if not room.stage(pages, aux=aux):
            continue  # failed already: its send() raises that
        if room.request is None:
            continue  # posted where its page list arrives
        ready.setdefault(room.request.peer, []).append(room)
    for peer, rooms in ready.items():
        if len(rooms) == 1:
            rooms[0]._post()
        else:
            _post_group(peer, rooms)


def _post_group(peer: PrefillPeer, rooms: list[PrefillRoom]) -> None:
    kv = rooms[0]._kv
    local: list[npt.NDArray[np.int64]] = []
    remote: list[npt.NDArray[np.int64]] = []
    fitting: list[PrefillRoom] = []
    for room in rooms:
        assert room.request is not None and room._ready is not None
        pages, theirs = room._ready[0], room.request.pages
        if pages.size != theirs.size:
            room.reject(ValueError(f"{pages.size} pages for {theirs.size} decode pages"))
            continue
        local.append(pages)
        remote.append(theirs)
        fitting.append(room)
    if not fitting:
        return
    try:
        start, _, _ = plan_write(kv, np.concatenate(local), np.concatenate(remote), peer)
    except ValueError as exc:
        for room in fitting:
            room.reject(exc)
        return
    page_bytes = kv.pool.page_bytes
    notif = encode_notifications([room.notification() for room in fitting])
    shared = SharedWrite(kv, peer.agent_name)
    for room in fitting:
        room.state = RoomState.TRANSFERRING
        room.group = shared
        room._abort = shared.abort
        kv._transfer_started(peer)
    kv._send(peer.routing_id, Writing(room=fitting[0].room, more=[r.room for r in fitting[1:]]))
    shared.take, shared.started = post_write(start, notif)
    for room, mine, theirs in zip(fitting, local, remote, strict=True):
        runs = count_runs(mine, theirs)
        room._posted = (shared.take, shared.started, int(mine.size) * page_bytes, runs)
        room._wake.set()


class SharedWrite:
    """One WRITE several rooms wait for: the first to wait polls it to its end (as
    :func:`write_pages` does for one room), the others wait for that."""

    def __init__(self, kv: PrefillKV, remote: str) -> None:
        self._kv = kv
        self._remote = remote
        self.abort = anyio.Event()  # every room's: aborting one stops the WRITE
        self.take: Callable[[], tuple[XferHandle, XferState]] | None = None  # see post_write
        self.started = 0.0
        self._polling = False
        self._done = anyio.Event()
        self._result: float | RequestError = 0.0
        self._counted = False

    def count_time(self) -> bool:
        """Whether the asking room counts the WRITE's time in the statistics (the first only)."""
        first, self._counted = not self._counted, True
        return first

    async def wait(self) -> float:
        """The seconds from posting to NIXL's DONE, once the WRITE is terminal; raises what
        ended it (:class:`~protocols.errors.KVTransferError`, :class:`TransferAborted`)."""
        if not self._polling:
            self._polling = True
            assert self.take is not None
            try:
                seconds = await self._kv._write_pages(
                    self.take, self._remote, self.abort, self.started
                )
            except BaseException as exc:
                self._result = (
                    exc
                    if isinstance(exc, RequestError)
                    else TransferAborted(f"the shared WRITE to {self._remote} was stopped")
                )
                raise
            finally:
                self._done.set()
            self._result = seconds
            return seconds
        try:
            await self._done.wait()
        except BaseException:
            # Cancelled: our pages may be freed once we return. Stop the WRITE, and wait for it
            # to settle.
            self.abort.set()
            with anyio.CancelScope(shield=True):
                await self._done.wait()
            raise
        result = self._result
        if isinstance(result, RequestError):
            raise type(result)(str(result))
        return result
