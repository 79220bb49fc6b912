"""Helpers for the KV transfer tests: a local (in-process) side and peer processes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio

from actors.kv import DecodeKV, KVConfig, KVPool, NixlAgent, PrefillKV
from actors.kv._peer import Outcome, PeerProcess, Stats

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
async def local_prefill(**kwargs: Any) -> AsyncIterator[PrefillKV]:
    """A prefill KV service in this process."""
    agent = NixlAgent(prefix="test-prefill")
    pool = KVPool.allocate(NUM_PAGES, PAGE_BYTES, device="cpu")
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


async def eventually(check: Any, timeout: float = 10.0) -> None:
    """Wait until ``check()`` is true (polling: the state lives in another process)."""
    with anyio.fail_after(timeout):
        while True:
            if await check():
                return
            await anyio.sleep(0.02)
