"""Helpers for the KV transfer tests: a local (in-process) side and peer processes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio

from actors.serving.kv import DecodeKV, KVConfig, KVPool, NixlAgent, PrefillKV
from actors.serving.kv._peer import Outcome, PeerProcess, Receive, Stats
from protocols.errors import KVTransferError

PAGE_BYTES = 4096
NUM_PAGES = 512
# Short heartbeats so failures are noticed quickly, with slack for a loaded 2-core machine.
HEARTBEAT = 0.1
PEER_TIMEOUT = 1.5
CONFIG = KVConfig(
    heartbeat_interval=HEARTBEAT,
    peer_timeout=PEER_TIMEOUT,
    bootstrap_timeout=10.0,
    transfer_timeout=10.0,
    receive_timeout=20.0,
)


@asynccontextmanager
async def local_decode(**kwargs: Any) -> AsyncIterator[DecodeKV]:
    """A decode KV service in this process; on exit everything must have been given back."""
    agent = NixlAgent(prefix="test-decode")
    pool = KVPool.allocate(NUM_PAGES, PAGE_BYTES, device="cpu")
    try:
        kwargs.setdefault("config", CONFIG)
        async with DecodeKV(agent, pool, **kwargs) as kv:
            yield kv
    finally:
        pool.close()
        agent.close()


@asynccontextmanager
async def local_prefill(
    *, threads: int = 0, num_pages: int = NUM_PAGES, page_bytes: int = PAGE_BYTES, **kwargs: Any
) -> AsyncIterator[PrefillKV]:
    """A prefill KV service in this process (its agent with ``threads`` posting threads)."""
    agent = NixlAgent(prefix="test-prefill", num_threads=threads)
    pool = KVPool.allocate(num_pages, page_bytes, device="cpu")
    try:
        kwargs.setdefault("config", CONFIG)
        async with PrefillKV(agent, pool, **kwargs) as kv:
            yield kv
    finally:
        pool.close()
        agent.close()


@asynccontextmanager
async def peer(
    role: str, ipc_dir: str, name: str = "ctl", **kwargs: Any
) -> AsyncIterator[tuple[PeerProcess, Outcome]]:
    """A peer process and its first ``Stats`` (its ``endpoint`` is a prefill's bootstrap)."""
    async with PeerProcess.start(
        role,
        f"ipc://{ipc_dir}/{name}",
        num_pages=NUM_PAGES,
        page_bytes=PAGE_BYTES,
        heartbeat=HEARTBEAT,
        peer_timeout=PEER_TIMEOUT,
        **kwargs,
    ) as proc:
        ready = await proc.wait_ready()
        yield proc, ready


async def peer_stats(proc: PeerProcess) -> dict[str, dict[str, Any]]:
    return (await proc.call(Stats())).info


async def assert_peer_clean(proc: PeerProcess) -> None:
    """The peer holds no page, allocation or transfer handle."""
    info = await peer_stats(proc)
    assert info["pool"]["pages_in_use"] == 0
    assert info["pool"]["allocations_live"] == 0
    assert info["agent"]["xfers_live"] == 0


async def receive_in_child(
    proc: PeerProcess, endpoint: str, room: int, n: int, seed: int, out: list[Outcome]
) -> None:
    """Have a decode peer receive ``room`` of prefill ``endpoint`` into ``n`` fresh pages (bytes
    checked against the pattern of ``seed``); its outcome goes to ``out``."""
    from actors.serving.kv import bootstrap_info

    out.append(
        await proc.call(Receive(bootstrap=bootstrap_info(endpoint, room), num_pages=n, seed=seed))
    )


async def send_to_faulted_peer(room: Any, alloc: Any, ended: anyio.Event) -> None:
    """``room.send(alloc)`` to a peer the test faults (stops or kills): the send may fail with
    ``KVTransferError`` or finish first, a real race; either way ``ended`` is set."""
    try:
        await room.send(alloc)
    except KVTransferError:
        pass
    finally:
        ended.set()
