"""Reply streams: a request, then replies with back-pressure, ended by a terminal item or a typed
error; closing early (or being cancelled) cancels the producer; a dying actor never leaves a
consumer hanging."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from actors import Actor, ActorCrashed, ActorNotRunning, ReplyError
from actors._backends import backend
from actors._stream import StreamChannel
from actors.testing import wait_until
from supervisors import ChildSpec, Restart, SupervisorFlags, open_supervisor
from tests.helpers.supervision import Boom, Refused, crash

FLAGS = SupervisorFlags(intensity=100)


class Producer(Actor):
    """Streams ``range(n)``, or for ever; records how far it got and how it ended."""

    def __init__(self) -> None:
        self.produced = 0
        self.ended: list[str] = []
        self.hold = anyio.Event()

    async def receive(self, message: Any) -> Any:
        match message:
            case "produced":
                return self.produced
            case "ended":
                return list(self.ended)
            case "crash":
                raise Boom("crash while streaming")
        return await super().receive(message)

    async def receive_stream(self, message: Any) -> AsyncIterator[Any]:
        try:
            match message:
                case int(n):
                    for i in range(n):
                        self.produced += 1
                        yield i
                case "forever":
                    while True:
                        self.produced += 1
                        yield self.produced
                case "one-then-hold":
                    self.produced += 1
                    yield "first"
                    await anyio.sleep_forever()
                case ("fail-after", int(n), str(how)):
                    for i in range(n):
                        yield i
                    if how == "reply":
                        raise Refused("no more")
                    raise Boom("stream handler crashed")
        except BaseException as exc:
            self.ended.append(type(exc).__name__)
            raise
        else:
            self.ended.append("done")


class NoStreams(Actor):
    async def receive(self, message: Any) -> Any:
        return message


async def _producer() -> ChildSpec:
    return ChildSpec("p", Producer)


async def test_stream_ends_with_its_terminal_item() -> None:
    async with open_supervisor([await _producer()]) as sup:
        ref = await sup.child("p")
        async with ref.stream(5) as replies:
            assert [r async for r in replies] == [0, 1, 2, 3, 4]
        with pytest.raises(StopAsyncIteration):
            await replies.receive()
        assert await ref.ask("ended") == ["done"]
        async with ref.stream(0) as replies:
            assert [r async for r in replies] == []


async def test_receive_nowait_takes_only_what_is_buffered() -> None:
    async with open_supervisor([await _producer()]) as sup:
        ref = await sup.child("p")
        async with ref.stream(3, buffer=8) as replies:
            with pytest.raises(anyio.WouldBlock):
                replies.receive_nowait()  # the producer has not run yet
            assert await replies.receive() == 0
            await wait_until(lambda: ref._cell.runtime.actor.ended == ["done"])
            assert replies.buffered == 2
            assert [replies.receive_nowait(), replies.receive_nowait()] == [1, 2]
            assert replies.buffered == 0
            with pytest.raises(anyio.WouldBlock):
                replies.receive_nowait()  # the end is for receive() to report
            with pytest.raises(StopAsyncIteration):
                await replies.receive()


async def test_timed_receive_times_out_and_the_stream_goes_on() -> None:
    async with open_supervisor([await _producer()]) as sup:
        ref = await sup.child("p")
        async with ref.stream("one-then-hold") as replies:
            assert await replies.receive(5.0) == "first"
            with pytest.raises(TimeoutError):
                await replies.receive(0.05)  # the handler holds: nothing comes
            with pytest.raises(TimeoutError):
                await replies.receive(0.05)  # a second deadline of the same length
        await wait_until(lambda: ref._cell.runtime.actor.ended != [])
    async with open_supervisor([await _producer()]) as sup:
        ref = await sup.child("p")
        async with ref.stream(2) as replies:
            assert [await replies.receive(0.05) for _ in range(2)] == [0, 1]
            with pytest.raises(StopAsyncIteration):
                await replies.receive(0.05)  # the end, not a timeout


async def test_timed_receives_of_one_channel_each_count_from_their_own_start() -> None:
    # The channel's timed receives share one entry in the deadline sweep: one that came due for
    # an earlier receive must not end a later one, nor a pending long one delay a short one.
    channel = StreamChannel(backend(), 8)

    async def produce() -> None:
        for i in range(30):
            await anyio.sleep(0.02)
            channel.push_many([i])

    async with anyio.create_task_group() as tg:
        tg.start_soon(produce)
        # 0.6 s in all, past the deadline the first receive filed.
        assert [await channel.receive(0.3) for _ in range(30)] == list(range(30))
    with anyio.move_on_after(0.05):
        await channel.receive(60.0)  # its entry stays filed
    with anyio.fail_after(10), pytest.raises(TimeoutError):
        await channel.receive(0.05)
    with anyio.fail_after(10), pytest.raises(TimeoutError):
        await channel.receive(0.05)  # a second deadline of the same length
    channel.push_many(["late"])
    assert await channel.receive(0.05) == "late"
    channel.finish()
    with pytest.raises(StopAsyncIteration):
        await channel.receive(0.05)


async def test_slow_consumer_bounds_the_producer_lead() -> None:
    async with open_supervisor([await _producer()]) as sup:
        ref = await sup.child("p")
        actor = ref._cell.runtime.actor
        consumed = 0
        async with ref.stream(200, buffer=4) as replies:
            async for _ in replies:
                consumed += 1
                for _ in range(20):  # let the producer run ahead as far as it can
                    await anyio.lowlevel.checkpoint()
                assert actor.produced - consumed <= 4 + 1
                assert actor.produced >= min(200, consumed + 4)  # and it did fill the buffer
        assert consumed == 200


async def test_closing_early_cancels_the_producer() -> None:
    async with open_supervisor([await _producer()]) as sup:
        ref = await sup.child("p")
        async with ref.stream("forever", buffer=2) as replies:
            assert await replies.receive() == 1
            assert await replies.receive() == 2
        await wait_until(lambda: ref._cell.runtime.actor.ended != [])
        ended = await ref.ask("ended")
        assert ended and ended[0] in (
            "StreamCancelled",
            "CancelledError",
            "Cancelled",
            "GeneratorExit",
        )
        assert await ref.ask("produced") <= 2 + 2 + 1
        assert ref.statistics().incarnation == 1  # a cancelled stream is no crash


async def test_closing_a_stream_waiting_in_the_handler_cancels_it() -> None:
    async with open_supervisor([await _producer()]) as sup:
        ref = await sup.child("p")
        replies = ref.stream("one-then-hold")
        assert await replies.receive() == "first"
        await replies.aclose()
        await wait_until(lambda: ref._cell.runtime.actor.ended != [])
        assert await ref.ask("produced") == 1
        assert ref.statistics().incarnation == 1


async def test_a_cancelled_consumer_cancels_the_producer() -> None:
    async with open_supervisor([await _producer()]) as sup:
        ref = await sup.child("p")
        with anyio.move_on_after(5) as outer:
            with anyio.CancelScope() as scope:
                async with ref.stream("one-then-hold") as replies:
                    assert await replies.receive() == "first"
                    scope.cancel()
                    await replies.receive()  # cancelled while waiting for the next reply
        assert not outer.cancelled_caught
        await wait_until(lambda: ref._cell.runtime.actor.ended != [])


async def test_reply_error_ends_the_stream_and_the_actor_goes_on() -> None:
    async with open_supervisor([await _producer()]) as sup:
        ref = await sup.child("p")
        got: list[int] = []
        with pytest.raises(Refused, match="no more"):
            async with ref.stream(("fail-after", 3, "reply")) as replies:
                async for r in replies:
                    got.append(r)
        assert got == [0, 1, 2]
        assert ref.statistics().incarnation == 1


async def test_crash_in_the_stream_handler_is_a_typed_error_and_crashes_the_actor() -> None:
    async with open_supervisor([await _producer()], FLAGS) as sup:
        ref = await sup.child("p")
        monitor = ref.monitor()
        got: list[int] = []
        with pytest.raises(ActorCrashed) as info:
            async with ref.stream(("fail-after", 2, "crash")) as replies:
                async for r in replies:
                    got.append(r)
        assert got == [0, 1]
        assert isinstance(info.value.reason.error, Boom)
        assert not ref.is_running  # the error came once the incarnation was gone
        assert (await monitor.wait()).reason.kind == "error"
        await sup.count_children()
        assert ref.statistics().incarnation == 2


async def test_actor_crashing_elsewhere_fails_a_waiting_stream() -> None:
    async with open_supervisor([await _producer()], FLAGS) as sup:
        ref = await sup.child("p")
        with anyio.fail_after(10):
            async with ref.stream("one-then-hold") as replies:
                assert await replies.receive() == "first"
                await crash(ref, sup)
                with pytest.raises(ActorCrashed) as info:
                    await replies.receive()
        assert isinstance(info.value.reason.error, Boom)


async def test_actor_killed_fails_a_waiting_stream() -> None:
    spec = ChildSpec("p", Producer, shutdown="brutal_kill", restart=Restart.TEMPORARY)
    async with open_supervisor([spec]) as sup:
        ref = await sup.child("p")
        with anyio.fail_after(10):
            async with ref.stream("one-then-hold") as replies:
                assert await replies.receive() == "first"
                await sup.terminate_child("p")
                with pytest.raises(ActorCrashed) as info:
                    await replies.receive()
        assert info.value.reason.kind == "killed"


async def test_buffered_replies_are_delivered_before_the_end() -> None:
    async with open_supervisor([await _producer()]) as sup:
        ref = await sup.child("p")
        replies = ref.stream(10, buffer=16)
        await wait_until(lambda: ref._cell.runtime.actor.ended == ["done"])
        assert [r async for r in replies] == list(range(10))


async def test_stream_to_an_actor_without_stream_handler_is_a_reply_error() -> None:
    async with open_supervisor([ChildSpec("n", NoStreams)]) as sup:
        ref = await sup.child("n")
        with pytest.raises(ReplyError, match="does not serve streams"):
            async with ref.stream("x") as replies:
                await replies.receive()
        assert await ref.ask("still here") == "still here"


async def test_stream_to_a_dead_actor_fails_fast() -> None:
    spec = ChildSpec("p", Producer, restart=Restart.TEMPORARY)
    async with open_supervisor([spec]) as sup:
        ref = await sup.child("p")
        await crash(ref, sup)
        with pytest.raises(ActorNotRunning):
            ref.stream(3)


async def test_graceful_stop_lets_a_running_stream_finish() -> None:
    async with open_supervisor([await _producer()]) as sup:
        ref = await sup.child("p")
        replies = ref.stream(50, buffer=64)
        await wait_until(lambda: ref._cell.runtime.actor.ended == ["done"])
    # The supervisor stopped; everything produced is still readable, then the end.
    assert [r async for r in replies] == list(range(50))
