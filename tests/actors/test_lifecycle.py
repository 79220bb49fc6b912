"""Lifecycle hooks: ``started`` runs before the actor counts as ready; ``stopping`` runs on a
graceful stop and after a crash, never on a kill; an actor's tasks never outlive it."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest

from actors import Actor, ActorCrashed, ExitReason
from actors.testing import hang, wait_until
from supervisors import ChildSpec, Restart, SupervisorFlags, open_supervisor
from tests.helpers.supervision import Boom, Journal, crash, exit_with

FLAGS = SupervisorFlags(intensity=100)


class Hooks(Actor):
    """Records its hooks, with the reason ``stopping`` got."""

    def __init__(
        self, journal: Journal, *, slow_start: bool = False, bad_stopping: bool = False
    ) -> None:
        self.journal = journal
        self.slow_start = slow_start
        self.bad_stopping = bad_stopping
        self.ready = False

    async def started(self) -> None:
        self.journal.add("started", "begin")
        if self.slow_start:
            for _ in range(10):
                await anyio.lowlevel.checkpoint()
        self.ready = True
        self.journal.add("started", "end")

    async def stopping(self, reason: ExitReason) -> None:
        self.journal.add("stopping", str(reason))
        if self.bad_stopping:
            raise Boom("stopping failed too")

    async def receive(self, message: Any) -> Any:
        match message:
            case "ready?":
                self.journal.add("message", "ready?")
                return self.ready
            case "crash":
                raise Boom("handler")
            case "spawn":
                self.start_soon(self._background)
                return None
            case "spawn-failing":
                self.start_soon(self._failing)
                return None
            case "stop_requested?":
                return self.stop_requested
        return await super().receive(message)

    async def _background(self) -> None:
        try:
            await anyio.sleep_forever()
        finally:
            self.journal.add("background", "ended")

    async def _failing(self) -> None:
        await anyio.lowlevel.checkpoint()
        raise Boom("background task")


def _spec(journal: Journal, **kwargs: Any) -> ChildSpec:
    spec: dict[str, Any] = {k: kwargs.pop(k) for k in ("restart", "shutdown") if k in kwargs}
    return ChildSpec("h", lambda: Hooks(journal, **kwargs), **spec)


async def test_started_runs_before_ready() -> None:
    journal = Journal()
    async with open_supervisor([_spec(journal, slow_start=True)]) as sup:
        journal.add("body", "")
        ref = await sup.child("h")
        assert await ref.ask("ready?") is True
    assert journal.events[:4] == [
        ("started", "begin"),
        ("started", "end"),
        ("body", ""),
        ("message", "ready?"),
    ]
    assert journal.events[4:] == [("stopping", "shutdown")]


async def test_stopping_on_graceful_stop_by_the_supervisor() -> None:
    journal = Journal()
    async with open_supervisor([_spec(journal)]) as sup:
        await sup.terminate_child("h")
        assert journal.of("stopping") == ["shutdown"]


async def test_stopping_on_own_stop_with_its_reason() -> None:
    journal = Journal()
    async with open_supervisor([_spec(journal, restart=Restart.TEMPORARY)]) as sup:
        ref = await sup.child("h")
        await exit_with(ref, ExitReason.shutdown("done"))
        assert journal.of("stopping") == ["shutdown: done"]


async def test_stopping_after_a_crash() -> None:
    journal = Journal()
    async with open_supervisor([_spec(journal)], FLAGS) as sup:
        ref = await sup.child("h")
        down = await crash(ref, sup)
        assert journal.of("stopping")[0] == str(down.reason)
        assert journal.of("started") == ["begin", "end", "begin", "end"]  # restarted


async def test_a_failing_stopping_does_not_hide_the_crash_reason() -> None:
    journal = Journal()
    async with open_supervisor([_spec(journal, bad_stopping=True)], FLAGS) as sup:
        ref = await sup.child("h")
        down = await crash(ref, sup)
        assert isinstance(down.reason.error, Boom) and "crashed" in str(down.reason)


async def test_no_stopping_on_kill() -> None:
    journal = Journal()
    async with open_supervisor([_spec(journal, shutdown="brutal_kill")]) as sup:
        ref = await sup.child("h")
        monitor = ref.monitor()
        await sup.terminate_child("h")
        assert (await monitor.wait()).reason.kind == "killed"
        assert journal.of("stopping") == []


async def test_no_stopping_when_killed_after_the_shutdown_timeout() -> None:
    journal = Journal()
    async with open_supervisor([_spec(journal, shutdown=0.01)]) as sup:
        ref = await sup.child("h")
        await hang(ref)
        monitor = ref.monitor()
        await sup.terminate_child("h")
        reason = (await monitor.wait()).reason
        assert reason.kind == "killed"
        assert journal.of("stopping") == []


async def test_stop_requested_is_visible_to_long_handlers() -> None:
    class Polite(Actor):
        def __init__(self) -> None:
            self.saw: list[bool] = []

        async def receive(self, message: Any) -> Any:
            if message == "work":
                while not self.stop_requested:
                    await anyio.sleep(0.001)
                self.saw.append(True)
                return None
            return await super().receive(message)

    actor = Polite()
    async with open_supervisor([ChildSpec("p", lambda: actor)]) as sup:
        await (await sup.child("p")).tell("work")
        await anyio.sleep(0.01)
        await sup.terminate_child("p")  # graceful: the handler sees the request and winds up
    assert actor.saw == [True]


async def test_tasks_end_with_their_actor() -> None:
    journal = Journal()
    async with open_supervisor([_spec(journal)], FLAGS) as sup:
        ref = await sup.child("h")
        await ref.ask("spawn")
        await crash(ref, sup)
        assert journal.of("background") == ["ended"]
        await ref.ask("spawn")
    assert journal.of("background") == ["ended", "ended"]


async def test_a_failing_task_crashes_its_actor() -> None:
    journal = Journal()
    async with open_supervisor([_spec(journal)], FLAGS) as sup:
        ref = await sup.child("h")
        monitor = ref.monitor()
        await ref.ask("spawn-failing")
        reason = (await monitor.wait()).reason
        assert isinstance(reason.error, Boom) and "background task" in str(reason)
        await sup.count_children()
        await wait_until(lambda: ref.is_running)
        with pytest.raises(ActorCrashed):
            await ref.ask("crash")
