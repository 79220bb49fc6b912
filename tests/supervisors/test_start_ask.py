"""``SupervisorRef.start_dynamic_ask``: a dynamic child started with its first message already in
its mailbox (one round trip instead of ``start_dynamic`` then ``ask``), with the start's outcomes
of ``start_dynamic``: failure, ``ignore``, and a temporary child that is never restarted."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from actors import Actor, ActorCrashed
from supervisors import (
    ChildSpec,
    ChildStartFailed,
    Restart,
    Strategy,
    SupervisorError,
    SupervisorFlags,
    open_supervisor,
)
from tests.helpers.supervision import (
    Boom,
    Journal,
    Refused,
    StartControl,
    Worker,
    worker_spec,
)

SIMPLE = SupervisorFlags(Strategy.SIMPLE_ONE_FOR_ONE, intensity=10)


class Counter(Actor):
    """Answers each message with how many it has handled (itself included) and its start
    argument: the first message it handles answers 1."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.seen = 0

    async def receive(self, message: Any) -> Any:
        self.seen += 1
        return (self.tag, self.seen, message)


async def test_the_message_is_the_first_the_child_handles() -> None:
    spec = ChildSpec("c", Counter, restart=Restart.TEMPORARY)
    async with open_supervisor([spec], SIMPLE) as sup:
        started = await sup.start_dynamic_ask("hello", "x")
        assert started is not None
        ref, reply = started
        assert reply == ("x", 1, "hello")
        assert await ref.ask("again") == ("x", 2, "again")
        assert [c.ref for c in await sup.which_children()] == [ref]


async def test_a_reply_error_comes_back_and_the_child_goes_on() -> None:
    spec = ChildSpec("w", lambda: Worker("w"), restart=Restart.TEMPORARY)
    async with open_supervisor([spec], SIMPLE) as sup:
        with pytest.raises(Refused):
            await sup.start_dynamic_ask(("refuse", "no"))
        [child] = await sup.which_children()
        assert await child.ref.ask("ping") == "pong"


async def test_a_crash_on_the_message_ends_the_temporary_child() -> None:
    spec = ChildSpec("w", lambda: Worker("w"), restart=Restart.TEMPORARY)
    async with open_supervisor([spec], SIMPLE) as sup:
        with pytest.raises(ActorCrashed) as caught:
            await sup.start_dynamic_ask("crash")
        assert isinstance(caught.value.reason.error, Boom)
        for _ in range(1000):  # a guard, not a timing: the supervisor handles the exit next
            if not await sup.which_children():
                break
            await anyio.sleep(0.001)
        assert await sup.which_children() == []  # temporary: not restarted


async def test_a_start_failure_is_child_start_failed() -> None:
    journal = Journal()
    control = StartControl(fail_always=True)
    spec = ChildSpec("w", lambda: Worker("w", journal, control), restart=Restart.TEMPORARY)
    async with open_supervisor([spec], SIMPLE) as sup:
        with pytest.raises(ChildStartFailed):
            await sup.start_dynamic_ask("ping")
        assert journal.of("start_failed") == ["w"]
        assert await sup.which_children() == []


async def test_a_start_function_that_raises_is_child_start_failed() -> None:
    def start() -> Actor:
        raise Boom("no actor")

    async with open_supervisor([ChildSpec("w", start)], SIMPLE) as sup:
        with pytest.raises(ChildStartFailed):
            await sup.start_dynamic_ask("ping")
        assert await sup.which_children() == []


async def test_an_ignored_start_is_none() -> None:
    control = StartControl(ignore=1)
    spec = ChildSpec("w", lambda: Worker("w", None, control), restart=Restart.TEMPORARY)
    async with open_supervisor([spec], SIMPLE) as sup:
        assert await sup.start_dynamic_ask("ping") is None
        assert await sup.which_children() == []
        started = await sup.start_dynamic_ask("ping")
        assert started is not None and started[1] == "pong"


async def test_a_static_supervisor_refuses() -> None:
    async with open_supervisor([worker_spec("a")]) as sup:
        with pytest.raises(SupervisorError):
            await sup.start_dynamic_ask("ping")
