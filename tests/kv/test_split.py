"""Large WRITEs split over the prefill agent's posting threads (NIXL's UCX thread pool), between
real processes: bytes, the one notification, a decode death mid-split, leaks."""

from __future__ import annotations

import dataclasses
from contextlib import AbstractAsyncContextManager

import anyio
import anyio.lowlevel
import numpy as np

from actors.serving.kv import RoomState, TransferAborted, new_room
from actors.serving.kv._bootstrap import pack_pages
from actors.serving.kv._nixl import SPLIT_BATCH
from actors.serving.kv._peer import (
    Connect,
    Outcome,
    PeerProcess,
    Prefill,
    WaitRoom,
    bootstrap_for,
    fill_pattern,
    pattern_pages,
)
from actors.testing import wait_until
from tests.kv.helpers import (
    CONFIG,
    HEARTBEAT,
    PAGE_BYTES,
    PEER_TIMEOUT,
    assert_peer_clean,
    local_decode,
    local_prefill,
    peer,
    peer_stats,
    receive_in_child,
    send_to_faulted_peer,
)

SPLIT = 16 * 1024  # bytes per thread at least: the test pools are small
THREADS = 3


async def test_split_writes_are_byte_exact_and_notified_once(ipc_dir: str) -> None:
    with anyio.fail_after(60):
        async with (
            peer("prefill", ipc_dir, threads=THREADS, split_min_bytes=SPLIT) as (proc, ready),
            local_decode() as kv,
        ):
            await kv.connect(ready.endpoint)
            assert (await peer_stats(proc))["agent"]["num_threads"] == THREADS
            host = kv.pool.host_view
            assert host is not None
            rng = np.random.default_rng(11)
            runs = np.concatenate([np.arange(0, 100), np.arange(150, 200), [300]])
            fresh = np.arange(0)  # prefill's pages: a fresh allocation (one run)
            cases = [
                # (decode's pages, prefill's pages, descriptors prefill posts)
                (np.arange(256), fresh, THREADS * SPLIT_BATCH),  # one run, cut in pieces
                (runs, fresh, THREADS * SPLIT_BATCH),  # three runs, cut in proportion
                (rng.permutation(512)[:100], fresh, 100),  # runs enough: NIXL splits by count
                (np.arange(64), rng.permutation(512)[:64], 64),  # prefill's side scattered
                (np.arange(2), fresh, 1),  # too small to split: the agent's own worker
            ]
            for seed, (pages, theirs, descriptors) in enumerate(cases, start=20):
                pages = pages.astype(np.int64)
                room = new_room()
                packed = pack_pages(theirs.astype(np.int64)) if theirs.size else b""
                await proc.call(Prefill(room=room, num_pages=pages.size, seed=seed, pages=packed))
                with kv.pool.alloc_exact(pages) as alloc:
                    got = await kv.receive(bootstrap_for(ready, room), alloc)
                    assert got.verified  # per-page checksums, taken once the notification came
                    assert np.array_equal(host[pages], pattern_pages(seed, pages.size, PAGE_BYTES))
                sent = await proc.call(WaitRoom(room=room))
                assert sent.ok and sent.descriptors == descriptors

            # Split WRITEs at once share the threads; each room still gets its own bytes.
            async def one(i: int) -> None:
                room = new_room()
                await proc.call(Prefill(room=room, num_pages=48, seed=40 + i))
                with kv.pool.alloc(48) as alloc:
                    await kv.receive(bootstrap_for(ready, room), alloc)
                    assert np.array_equal(host[alloc.pages], pattern_pages(40 + i, 48, PAGE_BYTES))
                assert (await proc.call(WaitRoom(room=room))).descriptors == THREADS * SPLIT_BATCH

            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(one, i)

            # Exactly one notification per room, none after its room was done.
            await anyio.sleep(HEARTBEAT)
            stats = kv.statistics()
            assert stats.rooms_done == len(cases) + 8 and stats.rooms_failed == 0
            assert stats.stray_notifications == 0
            assert kv.pool.statistics().pages_in_use == 0
            await assert_peer_clean(proc)


async def test_split_write_aborted_or_decode_killed_mid_way(ipc_dir: str) -> None:
    # 16 MiB pools, so that the abort or the kill may land in a WRITE (the race is real: the
    # WRITE often wins it, and then its room is done; every outcome must leave things clean).
    pages, page_bytes = 256, 64 * 1024
    config = dataclasses.replace(CONFIG, split_min_bytes=SPLIT)

    def decode(name: str) -> AbstractAsyncContextManager[PeerProcess]:
        return PeerProcess.start(
            "decode",
            f"ipc://{ipc_dir}/{name}",
            num_pages=pages,
            page_bytes=page_bytes,
            heartbeat=HEARTBEAT,
            peer_timeout=PEER_TIMEOUT,
        )

    with anyio.fail_after(60):
        async with local_prefill(
            threads=2, config=config, num_pages=pages, page_bytes=page_bytes
        ) as kv:
            async with decode("c0") as proc:
                # Prefill aborts once the WRITE is posted: send returns only when no chunk
                # writes any more, and decode hears of the abort only then.
                await proc.call(Connect(endpoint=kv.endpoint))
                out: list[Outcome] = []
                with kv.open_room() as room, kv.pool.alloc(pages) as alloc:
                    fill_pattern(kv.pool, alloc.pages, 11)

                    async def abort_once_posted() -> None:
                        while room.state == RoomState.REQUESTED:
                            await anyio.lowlevel.checkpoint()
                        room.abort()  # a no-op if the WRITE is already done

                    async with anyio.create_task_group() as tg:
                        args = (proc, kv.endpoint, room.room, pages, 11, out)
                        tg.start_soon(receive_in_child, *args)
                        await room.wait_requested(10)
                        tg.start_soon(abort_once_posted)
                        try:
                            await room.send(alloc)
                        except TransferAborted:
                            pass
                        assert kv.agent.statistics().xfers_live == 0
                assert out[0].ok or out[0].code == "kv.transfer_aborted"
                await assert_peer_clean(proc)

            async with decode("c1") as proc:
                await proc.call(Connect(endpoint=kv.endpoint))
                room = kv.open_room()
                alloc = kv.pool.alloc(pages)
                fill_pattern(kv.pool, alloc.pages, 12)
                ended = anyio.Event()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(receive_in_child, proc, kv.endpoint, room.room, pages, 12, [])
                    await room.wait_requested(10)
                    tg.start_soon(send_to_faulted_peer, room, alloc, ended)
                    while room.state == RoomState.REQUESTED:
                        await anyio.lowlevel.checkpoint()
                    proc.kill()  # the chunks are posted (or done): their threads see the death
                    await ended.wait()
                    tg.cancel_scope.cancel()
                # Terminal, and released only once no chunk can write any more.
                assert room.state in (RoomState.DONE, RoomState.FAILED)
                assert kv.agent.statistics().xfers_live == 0
                alloc.free()
                room.close()

            async def reaped() -> bool:
                return kv.statistics().peers == 0 and kv.agent.statistics().remote_agents == 0

            await wait_until(reaped)

            # The threads survived it: the next decode gets a split WRITE, byte-exact.
            async with decode("c2") as proc:
                await proc.call(Connect(endpoint=kv.endpoint))
                out = []
                with kv.open_room() as room, kv.pool.alloc(pages) as alloc:
                    fill_pattern(kv.pool, alloc.pages, 13)
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(
                            receive_in_child, proc, kv.endpoint, room.room, pages, 13, out
                        )
                        result = await room.send(alloc)
                assert out[0].ok and result.descriptors == 2 * SPLIT_BATCH
                await assert_peer_clean(proc)
            assert await kv.wait_transfers_done(5.0)
            assert kv.pool.statistics().pages_in_use == 0
            assert kv.agent.statistics().xfers_live == 0
