"""A burst of rooms whose senders wait with their pages (a drain's live migrations)."""

from __future__ import annotations

import anyio
import anyio.lowlevel

from actors.kv import RoomState
from actors.kv._peer import Connect, Outcome, fill_pattern
from tests.kv.helpers import assert_peer_clean, local_prefill, peer, receive_in_child

ROOMS = 6
PAGES = 4


async def test_waiting_senders_post_their_writes_where_the_page_lists_arrive(
    ipc_dir: str,
) -> None:
    # Every sender waits with its pages when decode's page lists come in: each WRITE goes out
    # where its page list is handled (so a burst's WRITEs are posted back to back), never at
    # its sender's later turn, so no room is ever seen requested and not yet transferring.
    with anyio.fail_after(60):
        async with local_prefill() as kv, peer("decode", ipc_dir) as (proc, _):
            await proc.call(Connect(endpoint=kv.endpoint))
            rooms = [kv.open_room() for _ in range(ROOMS)]
            allocs = [kv.pool.alloc(PAGES) for _ in rooms]
            for i, alloc in enumerate(allocs):
                fill_pattern(kv.pool, alloc.pages, 30 + i)
            requested: list[int] = []
            out: list[Outcome] = []

            async def watch() -> None:
                while any(r.state not in (RoomState.DONE, RoomState.FAILED) for r in rooms):
                    requested.extend(r.room for r in rooms if r.state is RoomState.REQUESTED)
                    await anyio.lowlevel.checkpoint()

            async with anyio.create_task_group() as tg:
                for room, alloc in zip(rooms, allocs, strict=True):
                    tg.start_soon(room.send, alloc)
                await anyio.sleep(0.01)  # every sender is waiting for its page list
                tg.start_soon(watch)
                for i, room in enumerate(rooms):
                    tg.start_soon(
                        receive_in_child, proc, kv.endpoint, room.room, PAGES, 30 + i, out
                    )
            assert requested == []
            assert len(out) == ROOMS and all(o.ok for o in out)
            assert kv.statistics().rooms_done == ROOMS
            for room, alloc in zip(rooms, allocs, strict=True):
                room.close()
                alloc.free()
            assert kv.is_quiescent() and kv.agent.statistics().xfers_live == 0
            await assert_peer_clean(proc)


async def test_a_sender_cancelled_while_waiting_posts_nothing_after(ipc_dir: str) -> None:
    # Its pages may be freed as soon as send() left: the page list arriving later finds the
    # room requested, and nothing is written.
    with anyio.fail_after(60):
        async with local_prefill() as kv, peer("decode", ipc_dir) as (proc, _):
            await proc.call(Connect(endpoint=kv.endpoint))
            room = kv.open_room()
            alloc = kv.pool.alloc(PAGES)
            with anyio.move_on_after(0.01):
                await room.send(alloc)
            alloc.free()
            out: list[Outcome] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(receive_in_child, proc, kv.endpoint, room.room, PAGES, 1, out)
                await room.wait_requested(10)
                assert room.state is RoomState.REQUESTED
                room.close()  # decode hears of it
            assert len(out) == 1 and not out[0].ok
            assert kv.is_quiescent() and kv.agent.statistics().xfers_live == 0
            assert kv.statistics().rooms_done == 0
            await assert_peer_clean(proc)
