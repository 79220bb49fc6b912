"""Moving pages: descriptor coalescing and splitting, and one WRITE driven to a terminal state.

Each NIXL descriptor costs a few microseconds (a small page alone moves far below copy speed), so
pages that are consecutive on *both* sides are merged
into one descriptor before the transfer is created: a request laid out contiguously in both pools
is a single descriptor and moves at copy speed.

An agent with posting threads (:class:`~actors.serving.kv._nixl.NixlAgent` ``num_threads``) splits a
transfer by descriptor count, so a large one is cut back up (:func:`split`) into as many
near-equal descriptors as gives each thread one chunk of
:data:`~actors.serving.kv._nixl.SPLIT_BATCH` descriptors (:func:`split_pieces`).

:func:`write_pages` posts the WRITE (its notification rides on it: NIXL delivers it after the
data) and polls the initiator's transfer state, spinning (yielding to other tasks) for a short
while and then backing off. Whatever happens (error, timeout, abort, cancellation) it returns only
once the transfer has reached a terminal state and its handle is released, so the caller may free
or reuse the pages afterwards.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import anyio.lowlevel
import numpy as np
import numpy.typing as npt

from actors.serving.kv._nixl import SPLIT_BATCH, NixlAgent, NixlError, XferHandle, XferState
from protocols.errors import KVTransferError
from protocols.kv import KVMemoryDesc

__all__ = [
    "Descriptors",
    "TransferAborted",
    "coalesce",
    "count_runs",
    "page_table",
    "probe_peer",
    "split",
    "split_pieces",
    "write_pages",
    "yield_cpu",
]


class TransferAborted(KVTransferError):
    """The WRITE was aborted on purpose (the room was cancelled or its peer was lost)."""

    code = "kv.transfer_aborted"


@dataclass(frozen=True, slots=True)
class Descriptors:
    """Coalesced ``Nx3`` ``(address, length, device)`` descriptor lists for both sides."""

    local: npt.NDArray[np.uint64]
    remote: npt.NDArray[np.uint64]
    nbytes: int

    @property
    def count(self) -> int:
        return int(self.local.shape[0])


def coalesce(
    local_pages: npt.NDArray[np.int64],
    local: KVMemoryDesc,
    remote_pages: npt.NDArray[np.int64],
    remote: KVMemoryDesc,
) -> Descriptors:
    """One descriptor per run of pages consecutive in both pools (page sizes must match)."""
    if local_pages.shape != remote_pages.shape:
        raise ValueError(f"{local_pages.size} local pages for {remote_pages.size} remote pages")
    if local.page_bytes != remote.page_bytes:
        raise ValueError("local and remote page sizes differ")
    n = int(local_pages.size)
    if n == 0:
        raise ValueError("no pages to move")
    for pages, desc in ((local_pages, local), (remote_pages, remote)):
        if int(pages.min()) < 0 or int(pages.max()) >= desc.num_pages:
            raise ValueError("page index out of the pool's range")
    breaks = np.flatnonzero((np.diff(local_pages) != 1) | (np.diff(remote_pages) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [n])))
    lengths = counts.astype(np.uint64) * np.uint64(local.page_bytes)

    def table(pages: npt.NDArray[np.int64], desc: KVMemoryDesc) -> npt.NDArray[np.uint64]:
        out = np.empty((starts.size, 3), dtype=np.uint64)
        out[:, 0] = np.uint64(desc.base_addr) + pages[starts].astype(np.uint64) * np.uint64(
            desc.page_bytes
        )
        out[:, 1] = lengths
        out[:, 2] = desc.device_id
        return out

    return Descriptors(
        local=table(local_pages, local),
        remote=table(remote_pages, remote),
        nbytes=n * local.page_bytes,
    )


_SPLIT_ALIGN = 4096  # pieces are whole 4 KiB blocks of their run (but for a run's last one)


def split_pieces(nbytes: int, threads: int, min_bytes: int) -> int:
    """How many descriptors a WRITE of ``nbytes`` should have for an agent with ``threads``
    posting threads, when each thread's chunk must carry ``min_bytes`` or more: one chunk of
    ``SPLIT_BATCH`` descriptors per thread used, or 0 when it is not worth splitting."""
    chunks = min(threads, nbytes // max(1, min_bytes))
    return chunks * SPLIT_BATCH if chunks >= 2 else 0


def split(descs: Descriptors, pieces: int) -> Descriptors:
    """Cut the runs of ``descs`` into about ``pieces`` descriptors of near-equal size.

    Each run is cut into a share of the pieces in proportion to its length (the longest pieces
    are cut first), at 4 KiB boundaries. Lists that already have ``pieces`` descriptors or more
    are returned as they are: NIXL's threads split them by count.
    """
    count = descs.count
    if count >= pieces:
        return descs
    lengths = [int(n) for n in descs.local[:, 1]]
    cuts = [1] * count
    limit = [max(1, n // _SPLIT_ALIGN) for n in lengths]
    heap = [(-float(n), i) for i, n in enumerate(lengths) if limit[i] > 1]
    heapq.heapify(heap)
    for _ in range(pieces - count):
        if not heap:
            break
        _, i = heapq.heappop(heap)
        cuts[i] += 1
        if cuts[i] < limit[i]:
            heapq.heappush(heap, (-lengths[i] / cuts[i], i))
    total = sum(cuts)
    local = np.empty((total, 3), dtype=np.uint64)
    remote = np.empty((total, 3), dtype=np.uint64)
    row = 0
    for i, (n, k) in enumerate(zip(lengths, cuts, strict=True)):
        bounds = [j * n // k // _SPLIT_ALIGN * _SPLIT_ALIGN for j in range(k)] + [n]
        offsets = np.array(bounds[:-1], dtype=np.uint64)
        sizes = np.diff(np.array(bounds, dtype=np.uint64))
        for out, src in ((local, descs.local), (remote, descs.remote)):
            out[row : row + k, 0] = src[i, 0] + offsets
            out[row : row + k, 1] = sizes
            out[row : row + k, 2] = src[i, 2]
        row += k
    return Descriptors(local=local, remote=remote, nbytes=descs.nbytes)


async def write_pages(
    agent: NixlAgent,
    start: Callable[[], tuple[XferHandle, XferState]],
    remote_agent: str,
    *,
    timeout: float,
    abort: anyio.Event | None = None,
    spin_s: float = 0.02,
    yields: bool = False,
    settle_timeout: float = 5.0,
    started: float | None = None,
) -> float:
    """Post a WRITE (``start()``) to ``remote_agent`` and wait until NIXL reports it done.

    Returns the seconds from posting to NIXL's DONE: the data and the notification are at the
    target then; releasing the handle afterwards is bookkeeping that delays nobody.

    Raises :class:`~protocols.errors.KVTransferError` on a NIXL error or after ``timeout``, and
    :class:`TransferAborted` once ``abort`` is set. In every case, cancellation included, it
    returns only after the transfer is terminal (bounded by ``settle_timeout``). It polls
    without sleeping for ``spin_s`` (yielding the CPU between polls if ``yields``), then backs
    off. ``started``: the ``time.perf_counter()`` at which ``start`` posted the WRITE, when the
    caller posted it ahead (``start`` then returns its handle).
    """
    t0 = time.perf_counter() if started is None else started
    try:
        handle, state = start()
    except NixlError as exc:
        raise KVTransferError(f"WRITE to {remote_agent} could not be posted: {exc}") from exc
    t1 = time.perf_counter()
    polls = 0
    spinning = False
    try:
        begin = time.monotonic()
        deadline = begin + timeout
        delay = 0.0
        while state == "PROC":
            if abort is not None and abort.is_set():
                raise TransferAborted(f"WRITE to {remote_agent} aborted")
            now = time.monotonic()
            if now > deadline:
                raise KVTransferError(f"WRITE to {remote_agent} timed out after {timeout:.3g} s")
            if now - begin > spin_s:
                if spinning:
                    spinning = False
                    _Spin.spinners -= 1
                # The event loop's timers are 1 ms coarse anyway.
                delay = min(0.001, delay * 2 or 0.0001)
                await anyio.sleep(delay)
            else:
                if yields:
                    if not spinning:
                        spinning = True
                        _Spin.spinners += 1
                    yield_cpu()
                await anyio.lowlevel.checkpoint()
            state = agent.state(handle)
            polls += 1
        if state == "ERR":
            raise KVTransferError(f"WRITE to {remote_agent} failed")
        t2 = time.perf_counter()
        return t2 - t0
    finally:
        if spinning:
            _Spin.spinners -= 1
        t2 = time.perf_counter()
        with anyio.CancelScope(shield=True):
            await _settle(agent, handle, settle_timeout)
        if PROFILE is not None:
            make, post = agent.last_post
            PROFILE.append((make, post, t2 - t1, time.perf_counter() - t2, polls))


PROFILE: list[tuple[float, float, float, float, int]] | None = None
"""When a list, each WRITE appends (create s, post s, poll s, release s, polls): a probe for
benchmarks."""


def count_runs(local_pages: npt.NDArray[np.int64], remote_pages: npt.NDArray[np.int64]) -> int:
    """How many descriptors :func:`coalesce` (or NIXL's own merge) makes of these pages."""
    if local_pages.size == 0:
        return 0
    breaks = (np.diff(local_pages) != 1) | (np.diff(remote_pages) != 1)
    return 1 + int(np.count_nonzero(breaks))


def page_table(desc: KVMemoryDesc) -> npt.NDArray[np.uint64]:
    """One ``(address, length, device)`` descriptor per page of a pool, for a prepared list."""
    out = np.empty((desc.num_pages, 3), dtype=np.uint64)
    out[:, 0] = np.uint64(desc.base_addr) + np.arange(desc.num_pages, dtype=np.uint64) * np.uint64(
        desc.page_bytes
    )
    out[:, 1] = desc.page_bytes
    out[:, 2] = desc.device_id
    return out


class _Spin:
    """The pollers of this process spinning now (one event loop: no lock needed)."""

    spinners = 0  # write_pages loops in their spinning phase
    polls = 0  # polls since the last yield


def yield_cpu() -> None:
    """Give the CPU away for a moment while spinning on NIXL progress.

    Completing a WRITE needs the target's UCX progress as well as ours. On a small machine a
    pure spin (``anyio.sleep(0)`` never leaves the process) starves the peer that must answer:
    ``time.sleep(0)`` between polls lets it run (``sched_yield`` does not, enough). On a large
    host it costs next to nothing per poll.

    Pollers spinning together (a drain's WRITEs, one poller each) yield once per round between
    them: each yield costs its caller the rest of its time slice on a busy machine, so a yield
    per poller per round delayed the posting of the next WRITEs by the number in flight.
    """
    _Spin.polls += 1
    if _Spin.polls >= _Spin.spinners:
        _Spin.polls = 0
        time.sleep(0)  # a zero sleep: a scheduler hint, it never blocks


async def _settle(agent: NixlAgent, handle: XferHandle, timeout: float) -> None:
    """Release ``handle``; an active transfer NIXL cannot cancel is polled to its end first, and
    with posting threads any transfer is (within ``timeout``)."""
    deadline = time.monotonic() + timeout
    if agent.num_threads:
        # A chunk may be copying in a posting thread: releasing cancels its requests, not a
        # copy under way, which would go on writing after we return. Let the chunks end.
        while time.monotonic() < deadline:
            if agent.state(handle) != "PROC":
                break
            await anyio.sleep(0.0005)
    while not agent.release(handle):
        if time.monotonic() > deadline:
            # The handle stays in the agent's live count: a visible leak rather than a reuse
            # of memory that a transfer may still write.
            raise KVTransferError(f"WRITE to {handle.remote} could not be cancelled")
        if agent.state(handle) == "PROC":
            await anyio.sleep(0.001)


async def probe_peer(
    agent: NixlAgent,
    scratch: npt.NDArray[np.uint64],
    scratch_mem: KVMemoryDesc,
    remote: KVMemoryDesc,
    remote_agent: str,
    *,
    timeout: float,
) -> bool:
    """READ a few bytes of the peer's pool into ``scratch``: wires up the UCX lanes and the
    remote key, so the first request's WRITE does not pay for it (tens of ms). With posting
    threads the READ is split over them, so that their workers are wired up too. Reading leaves
    the peer's memory untouched. Returns whether the probe completed."""
    size = int(scratch[0, 1])
    remote_desc = np.array([[remote.base_addr, size, remote.device_id]], dtype=np.uint64)
    copies = max(1, agent.num_threads * SPLIT_BATCH)  # the same bytes, once per piece
    scratch, remote_desc = np.repeat(scratch[:1], copies, 0), np.repeat(remote_desc, copies, 0)
    try:
        handle, state = agent.post(
            "READ", scratch, scratch_mem.mem_type, remote_desc, remote.mem_type, remote_agent
        )
    except NixlError:
        return False
    try:
        deadline = time.monotonic() + timeout
        while state == "PROC" and time.monotonic() < deadline:
            await anyio.sleep(0.0005)
            state = agent.state(handle)
        return state == "DONE"
    finally:
        with anyio.CancelScope(shield=True):
            await _settle(agent, handle, timeout)
