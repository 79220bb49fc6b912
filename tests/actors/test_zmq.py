"""ZMQ sockets on anyio: no lost wake-up (messages that came while nobody waited, a send that
consumed the FD's edge), one waiter at a time, an abort that ends a wait, and on asyncio an FD
registered once that stays quiet while nobody waits."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.lowlevel
import pytest
import zmq

from actors._zmq import AsyncSocket
from actors.serving.kv._channel import Channel

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def pair() -> AsyncIterator[tuple[AsyncSocket, AsyncSocket]]:
    """Two connected DEALER sockets (each sends and receives)."""
    a = AsyncSocket.create(zmq.DEALER)
    b = AsyncSocket.create(zmq.DEALER)
    try:
        b.connect(a.bind("tcp://127.0.0.1:0"))
        yield a, b
    finally:
        a.close()
        b.close()


async def test_messages_that_came_while_nobody_waited_are_received() -> None:
    async with pair() as (a, b):
        with anyio.fail_after(10):
            for round_ in range(20):
                for i in range(3):
                    await b.send_multipart([f"{round_}-{i}".encode()])
                await anyio.sleep(0.002)  # they arrive while nobody waits on ``a``
                got = [await a.recv_multipart() for _ in range(3)]
                assert got == [[f"{round_}-{i}".encode()] for i in range(3)]


async def test_a_send_on_the_waiting_socket_does_not_lose_its_wake_up() -> None:
    async with pair() as (a, b):
        received: list[list[bytes]] = []

        async def receive() -> None:
            received.append(await a.recv_multipart())

        with anyio.fail_after(10):
            for i in range(50):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(receive)
                    await anyio.wait_all_tasks_blocked()  # ``a`` waits now
                    await b.send_multipart([b"to a"])
                    # Sends on ``a`` read its EVENTS, which may take the edge that announced
                    # the message to the waiting receiver.
                    for _ in range(3):
                        await a.send_multipart([b"to b"])
                for _ in range(3):
                    assert await b.recv_multipart() == [b"to b"]
                assert len(received) == i + 1


async def test_a_channel_loses_no_message_to_its_sends() -> None:
    # A Channel's sends skip the socket's own wake-up check: the drain after each send reads
    # EVENTS and handles what is queued, and leaves the edge armed for the reader, which must
    # still see what comes later while nobody sends.
    async with pair() as (a, b):
        handled: list[bytes] = []
        chan = Channel(a, lambda frames: handled.append(frames[0]))
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(chan.run)
                sent = 0
                for round_ in range(30):
                    await anyio.wait_all_tasks_blocked()  # the reader waits
                    await b.send_multipart([f"{round_}-early".encode()])
                    # Queued on ``a``, unseen by the reader (the loop is blocked) as our sends
                    # go out and may take the FD's edge.
                    time.sleep(0.002)  # noqa: ASYNC251
                    for _ in range(round_ % 3):
                        assert chan.send([b"to b"])
                        sent += 1
                    await b.send_multipart([f"{round_}-late".encode()])  # nobody sends now
                    while len(handled) < 2 * (round_ + 1):
                        await anyio.sleep(0.001)
                tg.cancel_scope.cancel()
            assert handled == [f"{r}-{w}".encode() for r in range(30) for w in ("early", "late")]
            assert [await b.recv_multipart() for _ in range(sent)] == [[b"to b"]] * sent


async def test_one_waiter_at_a_time() -> None:
    async with pair() as (a, _b):
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.wait_readable)
            await anyio.wait_all_tasks_blocked()
            with pytest.raises(anyio.BusyResourceError):
                await a.wait_readable()
            tg.cancel_scope.cancel()
        # The cancelled wait left nothing behind: the socket can be waited on again.
        with anyio.move_on_after(0.01):
            await a.wait_readable()


async def test_abort_ends_a_wait() -> None:
    async with pair() as (a, _b):
        failed = anyio.Event()

        async def wait() -> None:
            with pytest.raises(anyio.ClosedResourceError):
                await a.recv_multipart()
            failed.set()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(wait)
                await anyio.wait_all_tasks_blocked()
                a.abort()
            assert failed.is_set() and a.closed


async def test_an_unwaited_fd_stays_quiet() -> None:
    # On asyncio the FD stays registered with the loop between receives; trio waits per
    # receive, so there nothing calls back at all.
    async with pair() as (a, b):
        calls = 0
        on_readable = a._on_readable

        def counting() -> None:
            nonlocal calls
            calls += 1
            on_readable()

        a._on_readable = counting  # type: ignore[method-assign]
        await b.send_multipart([b"first"])
        assert await a.recv_multipart() == [b"first"]  # registers the FD
        # Found empty: the next message signals the FD (ZMQ signals a pipe that ran dry).
        assert a.recv_multipart_nowait() is None
        await b.send_multipart([b"second"])
        await anyio.sleep(0.05)  # arrives, nobody waits
        calls = 0
        for _ in range(100):
            await anyio.lowlevel.checkpoint()
        # A readable FD nobody re-armed would call back on every one of those loop turns.
        assert calls <= 1
        assert await a.recv_multipart() == [b"second"]
