"""A burst of rooms whose senders wait with their pages (a drain's live migrations)."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel

from actors.serving.kv import RoomState, post_together
from actors.serving.kv._peer import Connect, Outcome, fill_pattern
from protocols.errors import KVTransferError
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
            await _all_closed(kv, proc, rooms, allocs)


async def _all_closed(kv: Any, proc: Any, rooms: list[Any], allocs: list[Any]) -> None:
    """Close every room, free its pages: nothing is left on either side."""
    for room, alloc in zip(rooms, allocs, strict=True):
        room.close()
        alloc.free()
    assert kv.is_quiescent() and kv.agent.statistics().xfers_live == 0
    await assert_peer_clean(proc)


async def _requested_rooms(
    kv: Any, proc: Any, tg: Any, out: dict[int, Outcome]
) -> tuple[list[Any], list[Any]]:
    """ROOMS rooms and their pages (filled), each one's page list from the decode child here
    (its outcome, by room, to ``out``)."""
    allocs = [kv.pool.alloc(PAGES) for _ in range(ROOMS)]
    for i, alloc in enumerate(allocs):
        fill_pattern(kv.pool, alloc.pages, 40 + i)
    rooms = [kv.open_room() for _ in range(ROOMS)]

    async def receive(room: int, seed: int) -> None:
        got: list[Outcome] = []
        await receive_in_child(proc, kv.endpoint, room, PAGES, seed, got)
        out[room] = got[0]

    for i, room in enumerate(rooms):
        tg.start_soon(receive, room.room, 40 + i)
    while any(r.state is not RoomState.REQUESTED for r in rooms):
        await anyio.sleep(0.005)
    return rooms, allocs


async def test_rooms_posted_together_share_one_write_and_each_lands(ipc_dir: str) -> None:
    with anyio.fail_after(60):
        async with local_prefill() as kv, peer("decode", ipc_dir) as (proc, _):
            await proc.call(Connect(endpoint=kv.endpoint))
            out: dict[int, Outcome] = {}
            posted = kv.agent.statistics().xfers_posted
            async with anyio.create_task_group() as tg:
                rooms, allocs = await _requested_rooms(kv, proc, tg, out)
                post_together([(r, a, b"") for r, a in zip(rooms, allocs, strict=True)])
                # One WRITE for every room (one peer), posted before any sender awaits it.
                assert kv.agent.statistics().xfers_posted == posted + 1
                assert all(r.state is RoomState.TRANSFERRING for r in rooms)
                results = [await r.send() for r in rooms]
            # Each room's pages landed byte-exact, each notified on its own.
            assert len(out) == ROOMS and all(o.ok for o in out.values()), out
            assert [r.pages for r in results] == [PAGES] * ROOMS
            assert kv.statistics().rooms_done == ROOMS
            await _all_closed(kv, proc, rooms, allocs)


async def test_a_shared_write_leaves_out_a_failed_room_and_ends_as_one(ipc_dir: str) -> None:
    with anyio.fail_after(60):
        async with local_prefill() as kv, peer("decode", ipc_dir) as (proc, _):
            await proc.call(Connect(endpoint=kv.endpoint))
            out: dict[int, Outcome] = {}
            ended: list[str] = []
            async with anyio.create_task_group() as tg:
                rooms, allocs = await _requested_rooms(kv, proc, tg, out)
                rooms[0].abort("its request went elsewhere")  # before the post: left out
                post_together([(r, a, b"") for r, a in zip(rooms, allocs, strict=True)])
                # Aborting a room of the shared WRITE stops it for all of them, unless it is
                # done already (a small WRITE in host memory may be, at once).
                rooms[3].abort("its request went elsewhere")
                for room in rooms:
                    try:
                        await room.send()
                        ended.append("done")
                    except KVTransferError as exc:
                        ended.append(type(exc).__name__)
            assert ended[0] == "TransferAborted"
            assert ended[1:] in (["done"] * (ROOMS - 1), ["TransferAborted"] * (ROOMS - 1))
            # Each receive heard how its room ended; nothing is left on either side.
            assert {room: o.ok for room, o in out.items()} == {
                r.room: e == "done" for r, e in zip(rooms, ended, strict=True)
            }
            await _all_closed(kv, proc, rooms, allocs)


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
