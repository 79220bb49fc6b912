"""What both ends of the bootstrap channel share: configuration, rooms, endpoints, page codecs.

The channel is ZMQ: the prefill worker binds a ROUTER (its *bootstrap endpoint*, on 127.0.0.1
or ``ipc://`` by default), every decode worker connects one DEALER to it. An endpoint travels in
SGLang's bootstrap triple as ``(host, port)``: a TCP endpoint as its host and port, an ``ipc://``
endpoint as the whole address in ``host`` with port 0.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from protocols.engine import BootstrapInfo
from protocols.kv import ROOM_BITS, MemoryKind

THREADS_ENV = "ACTORSERVE_KV_THREADS"

__all__ = [
    "THREADS_ENV",
    "KVConfig",
    "bootstrap_endpoint",
    "bootstrap_info",
    "new_room",
    "pack_pages",
    "unpack_pages",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class KVConfig:
    """Timeouts and polling of the KV transfer service (seconds).

    ``heartbeat_interval``/``peer_timeout``: decode pings every prefill peer, prefill answers;
    a side that hears nothing from its peer for ``peer_timeout`` declares it dead (prefill
    aborts the peer's rooms and frees their pages; decode fails its rooms with a migratable
    :class:`~protocols.errors.KVTransferError`).
    ``bootstrap_timeout``: how long prefill waits for decode's page list (and a room request
    for a room prefill has not opened yet is kept); decode forgets a prefill endpoint silent
    that long with nothing of its own left there. Decode waits ``peer_timeout`` for ``Welcome``.
    ``transfer_timeout``: one WRITE, post to done. ``receive_timeout``: decode's default wait
    for a room's KV, from its request (so it includes prefill's compute time).
    ``settle_timeout``: how long an aborted WRITE may take to become terminal.
    ``idle_poll_s``: the decode side's NIXL notification poll when no write is announced
    (it also answers UCX wire-up); while one is, it polls without sleeping.
    ``spin_s``: the initiator spins on the transfer state this long before backing off.
    ``poll_while_pending``: decode polls hard (yielding the CPU between polls) whenever a room
    is pending, not only once prefill announced its WRITE. Completing a WRITE needs the
    target's UCX progress, so this removes the announcement's latency (a ZMQ hop and a wake-up)
    from every transfer, at the price of a busy core while requests wait for prefill: worth
    it on a GPU host with cores to spare, not on a small shared CPU machine.
    ``yield_cpu``: give the CPU away (``time.sleep(0)``) between polls while spinning.
    On a small machine a pure spin starves the peer whose progress the WRITE needs; on a big
    host the yield only adds latency. ``None`` decides by core count (yield on 4 or fewer).
    ``prepared_dlists``: prepare the descriptor lists of the local pool and of each peer's pool
    once (when the peers meet) and build each WRITE from page indices; otherwise every WRITE
    builds and validates its descriptor lists from scratch.
    ``transfer_threads``: posting threads of the NIXL agent a prefill service WRITEs from
    (:meth:`agent_threads`; pass it to :class:`~actors.serving.kv.NixlAgent`). On one host UCX
    copies host memory with ``process_vm_writev`` in the posting thread, below memcpy speed from one
    thread and above it from four, so a large WRITE is split over the threads. ``None``: the
    ``ACTORSERVE_KV_THREADS`` environment variable if set, else ``min(4, cores // 4)`` (none
    under 2) for host memory; never for GPU memory (its copies are the copy engines' work, and
    they already reach the link's speed from one thread). An explicit value applies to both.
    ``split_min_bytes``: a WRITE is split only in chunks of at least this many bytes, one per
    thread (a smaller one takes the agent's own worker, without a thread hop): from 4 MiB by
    default (a chunk's thread hop costs tens of microseconds, its 2 MiB copy hundreds).
    """

    heartbeat_interval: float = 0.25
    peer_timeout: float = 2.0
    bootstrap_timeout: float = 30.0
    transfer_timeout: float = 30.0
    receive_timeout: float = 120.0
    settle_timeout: float = 5.0
    idle_poll_s: float = 0.005
    spin_s: float = 0.02
    poll_while_pending: bool = False
    yield_cpu: bool | None = None
    prepared_dlists: bool = True
    verify: bool = True
    transfer_threads: int | None = None
    split_min_bytes: int = 2 << 20

    def __post_init__(self) -> None:
        if self.peer_timeout <= self.heartbeat_interval:
            raise ValueError("peer_timeout must exceed heartbeat_interval")
        if self.transfer_threads is not None and self.transfer_threads < 0:
            raise ValueError("transfer_threads must be >= 0")
        if self.split_min_bytes <= 0:
            raise ValueError("split_min_bytes must be positive")

    def agent_threads(self, mem_type: MemoryKind) -> int:
        """Posting threads for a sending agent over a pool of ``mem_type``: see
        ``transfer_threads``."""
        if self.transfer_threads is not None:
            return self.transfer_threads
        if mem_type != "DRAM":
            return 0
        env = os.environ.get(THREADS_ENV)
        if env:
            try:
                threads = int(env)
            except ValueError:
                raise ValueError(f"{THREADS_ENV}={env!r} is not an integer") from None
            if threads < 0:
                raise ValueError(f"{THREADS_ENV}={env!r} is negative")
            return threads
        threads = min(4, (os.cpu_count() or 1) // 4)
        return threads if threads >= 2 else 0

    @property
    def yields(self) -> bool:
        """Whether spinning pollers yield the CPU between polls (see ``yield_cpu``)."""
        if self.yield_cpu is not None:
            return self.yield_cpu
        return (os.cpu_count() or 1) <= 4


def new_room() -> int:
    """A fresh random 63-bit room, as SGLang's router draws them."""
    return secrets.randbits(ROOM_BITS)


def check_room(room: int) -> int:
    if not 0 <= room < (1 << ROOM_BITS):
        raise ValueError(f"room {room} is not a non-negative 63-bit integer")
    return room


def bootstrap_info(endpoint: str, room: int) -> BootstrapInfo:
    """The bootstrap triple for a room of the prefill worker bound at ``endpoint``."""
    if endpoint.startswith("ipc://"):
        return BootstrapInfo(host=endpoint, port=0, room=room)
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"unsupported bootstrap endpoint {endpoint!r}")
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return BootstrapInfo(host=host, port=int(port), room=room)


def bootstrap_endpoint(info: BootstrapInfo) -> str:
    """The ZMQ endpoint a bootstrap triple names."""
    if info.host.startswith("ipc://"):
        return info.host
    return f"tcp://{info.host}:{info.port}"


def pack_pages(pages: npt.NDArray[np.int64]) -> bytes:
    return np.ascontiguousarray(pages, dtype="<i8").tobytes()


def unpack_pages(data: bytes) -> npt.NDArray[np.int64]:
    if len(data) % 8:
        raise ValueError("packed page list is not a multiple of 8 bytes")
    return np.frombuffer(data, dtype="<i8").astype(np.int64)
