"""actors.testing: polling with :func:`wait_until`, and faults injected into actors that know
nothing about them (:func:`crash`, :func:`exit_with`, :func:`hang`)."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest

import actors
from actors import Actor, ActorNotRunning, AskTimeout, ExitReason
from actors.testing import (
    InjectedCrash,
    VirtualClock,
    WaitTimeout,
    crash,
    exit_with,
    hang,
    wait_until,
)
from supervisors import ChildSpec, Restart, SupervisorFlags, open_supervisor

FLAGS = SupervisorFlags(intensity=100)


class Plain(Actor):
    """Knows no fault messages: records what it handled and the reasons ``stopping`` got."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def started(self) -> None:
        self.log.append("started")

    async def stopping(self, reason: ExitReason) -> None:
        self.log.append(f"stopping {reason.kind}")

    async def receive(self, message: Any) -> Any:
        if isinstance(message, str):
            self.log.append(message)
            return message
        return await super().receive(message)


def _spec(log: list[str], **spec: Any) -> ChildSpec:
    return ChildSpec("plain", lambda: Plain(log), **spec)


# -- wait_until --------------------------------------------------------------------------------


async def test_wait_until_a_plain_predicate() -> None:
    done: list[bool] = []

    async def later() -> None:
        for _ in range(3):
            await anyio.lowlevel.checkpoint()
        done.append(True)

    async with anyio.create_task_group() as tg:
        tg.start_soon(later)
        await wait_until(lambda: done == [True])


async def test_wait_until_an_async_predicate() -> None:
    calls = 0

    async def ready() -> bool:
        nonlocal calls
        calls += 1
        await anyio.lowlevel.checkpoint()
        return calls == 3

    await wait_until(ready)
    assert calls == 3


async def test_wait_until_slow_state_is_polled_with_sleeps() -> None:
    async with anyio.create_task_group() as tg:
        ready = anyio.Event()
        tg.start_soon(_set_after, ready, 0.05)
        await wait_until(ready.is_set, timeout=5)


async def _set_after(event: anyio.Event, seconds: float) -> None:
    await anyio.sleep(seconds)
    event.set()


async def test_wait_until_names_the_predicate_when_it_times_out() -> None:
    def never() -> bool:
        return False

    with pytest.raises(WaitTimeout, match=r"never .*test_testing\.py:\d+\) still false") as info:
        await wait_until(never, timeout=0.05)
    assert isinstance(info.value, TimeoutError)


async def test_wait_until_times_out_an_async_predicate() -> None:
    async def never() -> bool:
        return False

    with pytest.raises(WaitTimeout, match="never"):
        await wait_until(never, timeout=0.05)


def test_the_virtual_clock_is_the_runtimes() -> None:
    assert VirtualClock is actors.VirtualClock


# -- crash, exit_with ----------------------------------------------------------------------------


async def test_crash_after_the_queued_messages_then_restart() -> None:
    log: list[str] = []
    async with open_supervisor([_spec(log)], FLAGS) as sup:
        ref = await sup.child("plain")
        await ref.tell("first")
        await ref.tell("second")
        down = await crash(ref)
        assert down.ref == ref
        assert down.reason.kind == "error" and isinstance(down.reason.error, InjectedCrash)
        # Queued first, handled first; then stopping ran, as after any handler's crash.
        assert log == ["started", "first", "second", "stopping error"]
        await ref.wait_running(after=1)
        assert await ref.ask("again") == "again"
        assert ref.statistics().restarts == 1


async def test_crash_with_a_given_error() -> None:
    error = ValueError("injected")
    async with open_supervisor([_spec([])], FLAGS) as sup:
        down = await crash(await sup.child("plain"), error)
        assert down.reason.error is error and "injected" in str(down.reason)


async def test_exit_with_a_reason_is_a_graceful_stop() -> None:
    log: list[str] = []
    async with open_supervisor([_spec(log, restart=Restart.TRANSIENT)], FLAGS) as sup:
        ref = await sup.child("plain")
        down = await exit_with(ref, ExitReason.shutdown("done"))
        assert down.reason == ExitReason.shutdown("done")
        assert log == ["started", "stopping shutdown"]
        assert not ref.is_running  # transient: a shutdown is no failure, no restart


async def test_faults_need_a_running_actor() -> None:
    async with open_supervisor([_spec([], restart=Restart.TEMPORARY)], FLAGS) as sup:
        ref = await sup.child("plain")
        await sup.terminate_child("plain")
        with pytest.raises(ActorNotRunning):
            await crash(ref)
        with pytest.raises(ActorNotRunning):
            await hang(ref)
        with pytest.raises(ActorNotRunning):
            await exit_with(ref, ExitReason.normal())


# -- hang ----------------------------------------------------------------------------------------


async def test_hang_blocks_the_loop_until_a_kill() -> None:
    log: list[str] = []
    async with open_supervisor([_spec(log, shutdown=0.05)], FLAGS) as sup:
        ref = await sup.child("plain")
        await hang(ref)
        with pytest.raises(AskTimeout):
            await ref.ask("hello", timeout=0.05)
        monitor = ref.monitor()
        # The graceful stop cannot reach it: the shutdown timeout kills it, stopping never runs.
        await sup.terminate_child("plain")
        assert (await monitor.wait()).reason.kind == "killed"
        assert log == ["started"]


async def test_hang_fails_if_the_actor_dies_first() -> None:
    log: list[str] = []
    async with open_supervisor([_spec(log, restart=Restart.TEMPORARY)], FLAGS) as sup:
        ref = await sup.child("plain")
        await ref.tell(("unknown",))  # unhandled: crashes the actor before the hang is reached
        with pytest.raises(ActorNotRunning):
            await hang(ref)
