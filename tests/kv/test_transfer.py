"""KV transfer over real NIXL/UCX between real OS processes: data, failures, restarts, leaks."""

from __future__ import annotations

import os
import signal
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

from actors.serving.kv import KVConfig, RoomState, checksums_of, new_room
from actors.serving.kv._bootstrap import pack_pages
from actors.serving.kv._peer import (
    Connect,
    Outcome,
    Prefill,
    Release,
    WaitRoom,
    bootstrap_for,
    fill_pattern,
    pattern_pages,
)
from actors.testing import wait_until
from protocols.errors import KVCorrupted, KVTransferError
from tests.kv.helpers import (
    NUM_PAGES,
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


async def test_pages_move_byte_exact_contiguous_scattered_and_concurrent(ipc_dir: str) -> None:
    with anyio.fail_after(60):
        async with peer("prefill", ipc_dir) as (proc, ready), local_decode() as kv:
            await kv.connect(ready.endpoint)  # pre-warmed: metadata exchanged, NIXL connected
            pool = kv.pool
            host = pool.host_view
            assert host is not None

            # Contiguous on both sides: one descriptor for 64 pages.
            room = new_room()
            await proc.call(Prefill(room=room, num_pages=64, seed=1))
            with pool.alloc(64) as alloc:
                # The engine's own expectation (recomputed from the request's tokens).
                def expected() -> np.ndarray[Any, np.dtype[np.uint64]]:
                    return checksums_of(pattern_pages(1, 64, PAGE_BYTES))

                got = await kv.receive(
                    bootstrap_for(ready, room), alloc, expected_checksums=expected
                )
                assert got.verified and got.checksums is not None
                assert np.array_equal(host[alloc.pages], pattern_pages(1, 64, PAGE_BYTES))
            sent = await proc.call(WaitRoom(room=room))
            assert sent.ok and sent.descriptors == 1 and sent.nbytes == 64 * PAGE_BYTES

            # Scattered on both sides: every page its own descriptor, still byte-exact.
            rng = np.random.default_rng(7)
            theirs = rng.permutation(NUM_PAGES)[:100].astype(np.int64)
            ours = rng.permutation(NUM_PAGES)[:100].astype(np.int64)
            room = new_room()
            await proc.call(Prefill(room=room, num_pages=100, seed=2, pages=pack_pages(theirs)))
            with pool.alloc_exact(ours) as alloc:
                got = await kv.receive(bootstrap_for(ready, room), alloc)
                assert np.array_equal(host[ours], pattern_pages(2, 100, PAGE_BYTES))
            sent = await proc.call(WaitRoom(room=room))
            assert sent.ok and sent.descriptors >= 90

            # Many concurrent rooms; half of them ask before prefill has opened the room.
            async def one(i: int) -> None:
                room = new_room()
                count = 4 + i % 13
                with pool.alloc(count) as alloc:
                    if i % 2:
                        async with anyio.create_task_group() as tg:
                            tg.start_soon(kv.receive, bootstrap_for(ready, room), alloc)
                            await anyio.sleep(0.01)
                            await proc.call(Prefill(room=room, num_pages=count, seed=100 + i))
                    else:
                        await proc.call(Prefill(room=room, num_pages=count, seed=100 + i))
                        await kv.receive(bootstrap_for(ready, room), alloc)
                    want = pattern_pages(100 + i, count, PAGE_BYTES)
                    assert np.array_equal(host[alloc.pages], want)
                assert (await proc.call(WaitRoom(room=room))).ok

            async with anyio.create_task_group() as tg:
                for i in range(24):
                    tg.start_soon(one, i)

            stats = kv.statistics()
            assert stats.rooms_done == 26 and stats.rooms_failed == 0
            assert stats.lazy_connects == 0 and stats.pages_quarantined == 0
            assert pool.statistics().pages_in_use == 0
            assert kv.agent.statistics().xfers_live == 0
            await assert_peer_clean(proc)
            info = await peer_stats(proc)
            assert info["kv"]["open_rooms"] == 0 and info["kv"]["rooms_done"] == 26
            assert info["agent"]["remote_agents"] == 1


async def test_corrupted_page_and_cancelled_receive(ipc_dir: str) -> None:
    with anyio.fail_after(40):
        async with peer("prefill", ipc_dir) as (proc, ready), local_decode() as kv:
            await kv.connect(ready.endpoint)

            # One corrupted page: a typed, migratable KVCorrupted, and the pages go back.
            room = new_room()
            await proc.call(Prefill(room=room, num_pages=16, seed=3, corrupt=5))
            alloc = kv.pool.alloc(16)
            with pytest.raises(KVCorrupted, match="1 of 16 pages"):
                await kv.receive(bootstrap_for(ready, room), alloc)
            assert alloc.freed  # the transfer was terminal: the pages went straight back
            assert KVCorrupted.migratable
            assert kv.statistics().rooms_corrupted == 1

            # Cancelled mid hand-off (prefill holds the room): the pages stay quarantined until
            # prefill confirms nothing more will be written, then go back; prefill is told.
            room = new_room()
            await proc.call(Prefill(room=room, num_pages=32, seed=5, hold=True))
            alloc = kv.pool.alloc(32)
            async with anyio.create_task_group() as tg:
                tg.start_soon(kv.receive, bootstrap_for(ready, room), alloc)

                async def requested() -> bool:
                    return bool((await peer_stats(proc))["kv"]["requested_rooms"] == 1)

                await wait_until(requested)
                tg.cancel_scope.cancel()
            assert await kv.wait_idle(5.0)
            assert alloc.freed and kv.pool.statistics().pages_in_use == 0
            await proc.call(Release(room=room))
            outcome = await proc.call(WaitRoom(room=room))
            assert not outcome.ok and outcome.code == "kv.decode_cancelled"

            room = new_room()  # and the next room is fine
            await proc.call(Prefill(room=room, num_pages=16, seed=4))
            with kv.pool.alloc(16) as alloc:
                assert (await kv.receive(bootstrap_for(ready, room), alloc)).verified
            assert kv.pool.statistics().pages_in_use == 0
            await assert_peer_clean(proc)
            assert (await peer_stats(proc))["kv"]["open_rooms"] == 0


async def test_a_receive_times_out_and_its_pages_wait_for_prefill(ipc_dir: str) -> None:
    # The timeout (the event loop's deadline sweep, no timer of its own) ends the receive with a
    # migratable error; prefill still holds the room, so the pages wait (quarantined) until it
    # confirms nothing more will be written.
    with anyio.fail_after(40):
        async with peer("prefill", ipc_dir) as (proc, ready), local_decode() as kv:
            await kv.connect(ready.endpoint)
            room = new_room()
            await proc.call(Prefill(room=room, num_pages=8, seed=6, hold=True))
            alloc = kv.pool.alloc(8)
            with pytest.raises(KVTransferError, match="in time"):
                await kv.receive(bootstrap_for(ready, room), alloc, timeout=0.05)
            assert kv.statistics().rooms_failed == 1
            await proc.call(Release(room=room))
            assert not (await proc.call(WaitRoom(room=room))).ok
            assert await kv.wait_idle(5.0)
            assert alloc.freed and kv.pool.statistics().pages_in_use == 0

            room = new_room()  # a receive that did not time out leaves nothing in the sweep
            await proc.call(Prefill(room=room, num_pages=8, seed=7))
            with kv.pool.alloc(8) as alloc:
                assert (await kv.receive(bootstrap_for(ready, room), alloc, timeout=30)).verified
            await assert_peer_clean(proc)


async def test_prefill_killed_then_restarted_on_same_address(ipc_dir: str) -> None:
    boot = f"ipc://{ipc_dir}/bootstrap"
    with anyio.fail_after(40):
        async with local_decode() as kv:
            async with peer("prefill", ipc_dir, bootstrap=boot) as (proc, ready):
                await kv.connect(boot)
                room = new_room()
                await proc.call(Prefill(room=room, num_pages=32, seed=6, hold=True))
                alloc = kv.pool.alloc(32)
                errors: list[KVTransferError] = []
                failed = anyio.Event()

                async def receive() -> None:
                    try:
                        await kv.receive(bootstrap_for(ready, room), alloc)
                    except KVTransferError as exc:
                        errors.append(exc)
                        failed.set()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(receive)

                    async def requested() -> bool:
                        return bool((await peer_stats(proc))["kv"]["requested_rooms"] == 1)

                    await wait_until(requested)
                    proc.kill()
                    # A bounded, typed, migratable failure: the heartbeat notices the death.
                    with anyio.fail_after(PEER_TIMEOUT * 4):
                        await failed.wait()
                assert errors[0].migratable and "lost" in str(errors[0])
                assert alloc.freed and kv.pool.statistics().pages_in_use == 0

            # A new prefill process on the same address: decode meets it again by itself.
            async with peer("prefill", ipc_dir, name="ctl2", bootstrap=boot) as (proc, ready):
                room = new_room()
                await proc.call(Prefill(room=room, num_pages=8, seed=7))
                with kv.pool.alloc(8) as alloc:
                    got = await kv.receive(bootstrap_for(ready, room), alloc)
                    assert got.verified
                assert kv.statistics().prefill_restarts_seen == 1
                await assert_peer_clean(proc)
            assert kv.pool.statistics().pages_in_use == 0


async def test_decode_killed_mid_transfer_prefill_frees_pages(ipc_dir: str) -> None:
    with anyio.fail_after(40):
        async with local_prefill() as kv:
            # 1. Decode sent its page list, then died: the WRITE fails at once (peer gone).
            async with peer("decode", ipc_dir) as (proc, _):
                await proc.call(Connect(endpoint=kv.endpoint))
                room = kv.open_room()
                alloc = kv.pool.alloc(64)
                fill_pattern(kv.pool, alloc.pages, 8)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(receive_in_child, proc, kv.endpoint, room.room, 64, 8, [])
                    await room.wait_requested(10)
                    proc.kill()
                    await proc.process.wait()  # really gone (SIGKILL is asynchronous)
                    with pytest.raises(KVTransferError):
                        await room.send(alloc)
                    tg.cancel_scope.cancel()
                alloc.free()
                room.close()

            # 2. Decode is stopped, the WRITE posted, then decode is SIGKILLed. With CMA the copy
            # may even finish without the target (the race is real): either way the room ends
            # terminal, nothing leaks, and the dead peer is reaped.
            async with peer("decode", ipc_dir, name="ctl2") as (proc, _):
                await proc.call(Connect(endpoint=kv.endpoint))
                room = kv.open_room()
                alloc = kv.pool.alloc(256)
                fill_pattern(kv.pool, alloc.pages, 9)
                ended = anyio.Event()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(receive_in_child, proc, kv.endpoint, room.room, 256, 9, [])
                    await room.wait_requested(10)
                    os.kill(proc.pid, signal.SIGSTOP)
                    tg.start_soon(send_to_faulted_peer, room, alloc, ended)
                    await anyio.lowlevel.checkpoint()  # the WRITE is posted (or already failed)
                    proc.kill()
                    await ended.wait()
                    tg.cancel_scope.cancel()
                assert room.state in (RoomState.DONE, RoomState.FAILED)
                alloc.free()
                room.close()
            assert await kv.wait_transfers_done(5.0)
            assert kv.pool.statistics().pages_in_use == 0
            assert kv.statistics().rooms_failed >= 1

            async def reaped() -> bool:
                return kv.statistics().peers == 0 and kv.agent.statistics().remote_agents == 0

            await wait_until(reaped)
            assert kv.agent.statistics().xfers_live == 0


async def test_decode_restarted_on_same_worker_id_and_agent_name(ipc_dir: str) -> None:
    # A long peer timeout keeps the stale peer known when its successor says Hello: prefill
    # must replace it (remove the remote agent, then load the new metadata under the same name).
    with anyio.fail_after(40):
        async with local_prefill(config=KVConfig(peer_timeout=30.0)) as kv:
            for life in range(2):
                async with peer(
                    "decode",
                    ipc_dir,
                    name=f"ctl{life}",
                    worker_id="decode-0",
                    agent_name="decode-0-agent",
                ) as (proc, _):
                    await proc.call(Connect(endpoint=kv.endpoint))
                    with kv.open_room() as room, kv.pool.alloc(16) as alloc:
                        fill_pattern(kv.pool, alloc.pages, 10 + life)
                        out: list[Outcome] = []
                        async with anyio.create_task_group() as tg:
                            tg.start_soon(
                                receive_in_child, proc, kv.endpoint, room.room, 16, 10 + life, out
                            )
                            result = await room.send(alloc)
                        assert out[0].ok and result.descriptors == 1
                    if life == 0:
                        # Prefill aborts a room decode waits for: decode fails fast, migratable.
                        with kv.open_room() as room:
                            out = []
                            async with anyio.create_task_group() as tg:
                                tg.start_soon(
                                    receive_in_child, proc, kv.endpoint, room.room, 8, 0, out
                                )
                                await room.wait_requested(10)
                                room.abort("engine aborted the request")
                            assert out[0].code == "kv.transfer_aborted"
                        await assert_peer_clean(proc)
                        proc.kill()  # no Goodbye: the stale peer stays until replaced
            assert kv.statistics().peers_replaced == 1
            assert kv.pool.statistics().pages_in_use == 0

            async def gone() -> bool:  # the live one said Goodbye when it stopped
                return kv.statistics().peers == 0 and kv.agent.statistics().remote_agents == 0

            await wait_until(gone)
            stats = kv.agent.statistics()
            assert stats.xfers_live == 0
            assert stats.registrations == 2  # the pool and the probe scratch
            assert stats.dlists_live == 1  # the local pool's prepared page list; peers' are gone


async def test_a_silent_prefill_fails_connect_fast_and_is_forgotten(ipc_dir: str) -> None:
    # Nobody listens here: a prefill that died before decode ever met it. Decode must not wait
    # its bootstrap timeout (requests and the worker's mailbox would stall that long), and must
    # not keep pinging the dead endpoint for ever.
    gone = f"ipc://{ipc_dir}/gone"
    config = KVConfig(heartbeat_interval=0.05, peer_timeout=0.3, bootstrap_timeout=1.0)
    async with local_decode(config=config) as kv:
        with anyio.fail_after(config.bootstrap_timeout), pytest.raises(KVTransferError):
            await kv.connect(gone)
        kv.connect_soon(gone)  # a pre-warm: counted, not raised

        async def forgotten() -> bool:
            stats = kv.statistics()
            return stats.connections == 0 and stats.prewarm_failures == 1

        await wait_until(forgotten)
