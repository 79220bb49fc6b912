"""Monitors (a Down with the exit reason) and links (both ways, trap_exits, OTP's exit-signal
rules)."""

from __future__ import annotations

from typing import Any, ClassVar

import anyio
import pytest

from actors import Actor, ActorRef, Down, Exit, ExitReason, LinkedExit
from actors.testing import wait_until
from supervisors import ChildSpec, Restart, SupervisorFlags, SupervisorRef, open_supervisor
from tests.helpers.supervision import Boom, crash, exit_with, worker_spec

FLAGS = SupervisorFlags(intensity=100)


class Watcher(Actor):
    """Monitors or links to what it is told; records the Down and Exit notices it gets."""

    def __init__(self) -> None:
        self.notices: list[Down | Exit] = []
        self.monitors: dict[str, int] = {}

    async def receive(self, message: Any) -> Any:
        match message:
            case ("monitor", ActorRef() as ref):
                self.monitors[ref.name] = self.monitor(ref)
                return None
            case ("demonitor", ActorRef() as ref):
                self.demonitor(ref, self.monitors.pop(ref.name))
                return None
            case ("link", ActorRef() as ref):
                self.link(ref)
                return None
            case Down() | Exit():
                self.notices.append(message)
                return None
            case "notices":
                return list(self.notices)
            case "crash":
                raise Boom("watcher crashed")
            case ("exit", ExitReason() as reason):
                self.stop(reason)
                return None
            case "ping":
                return "pong"
        return await super().receive(message)


class Trapper(Watcher):
    trap_exits: ClassVar[bool] = True


def _specs(watcher: type[Actor] = Watcher, **target: Any) -> list[ChildSpec]:
    return [ChildSpec("watcher", watcher), worker_spec("target", **target)]


async def _refs(sup: SupervisorRef) -> tuple[ActorRef[Any], ActorRef[Any]]:
    return await sup.child("watcher"), await sup.child("target")


# -- monitors ----------------------------------------------------------------------------------


async def test_monitor_gets_down_with_the_exit_reason() -> None:
    async with open_supervisor(_specs(), FLAGS) as sup:
        _, target = await _refs(sup)
        monitor = target.monitor()
        down = await crash(target)
        assert down == await monitor.wait()
        assert down.ref == target
        assert down.reason.kind == "error"
        assert isinstance(down.reason.error, Boom)
        assert "target crashed" in str(down.reason)


@pytest.mark.parametrize(
    "reason",
    [
        ExitReason.normal(),
        ExitReason.shutdown(),
        ExitReason.shutdown("done"),
        ExitReason.killed("x"),
    ],
    ids=str,
)
async def test_monitor_sees_every_exit_reason(reason: ExitReason) -> None:
    async with open_supervisor(_specs(restart=Restart.TEMPORARY), FLAGS) as sup:
        _, target = await _refs(sup)
        down = await exit_with(target, reason)
        assert down.reason == reason


async def test_monitor_sees_a_supervisor_termination() -> None:
    async with open_supervisor(_specs(), FLAGS) as sup:
        _, target = await _refs(sup)
        monitor = target.monitor()
        await sup.terminate_child("target")
        assert (await monitor.wait()).reason == ExitReason.shutdown()


async def test_monitor_of_a_dead_actor_is_down_at_once() -> None:
    async with open_supervisor(_specs(restart=Restart.TEMPORARY), FLAGS) as sup:
        watcher, target = await _refs(sup)
        first = await crash(target, sup)
        with anyio.fail_after(5):
            down = await target.monitor().wait()
        assert down.reason == first.reason
        await watcher.ask(("monitor", target))
        notices = await watcher.ask("notices")
        assert notices == [Down(target, first.reason)]


async def test_monitor_is_one_incarnation() -> None:
    async with open_supervisor(_specs(), FLAGS) as sup:
        _, target = await _refs(sup)
        monitor = target.monitor()
        await crash(target, sup)
        assert (await monitor.wait()).reason.kind == "error"
        second = target.monitor()
        await sup.terminate_child("target")
        assert (await second.wait()).reason.kind == "shutdown"


async def test_actor_monitor_delivers_down_to_receive() -> None:
    async with open_supervisor(_specs(), FLAGS) as sup:
        watcher, target = await _refs(sup)
        await watcher.ask(("monitor", target))
        down = await crash(target)
        assert await watcher.ask("notices") == [down]
        assert watcher.statistics().incarnation == 1  # a Down is a message, not a failure


async def test_demonitor() -> None:
    async with open_supervisor(_specs(), FLAGS) as sup:
        watcher, target = await _refs(sup)
        await watcher.ask(("monitor", target))
        await watcher.ask(("demonitor", target))
        await crash(target)
        assert await watcher.ask("notices") == []
        external = target.monitor()
        external.cancel()
        await crash(target, sup)
        assert external._reason is None


async def test_monitors_of_a_dead_watcher_are_dropped() -> None:
    """A watcher that monitors a long-lived actor and restarts many times leaves nothing behind
    on the watched actor (OTP drops a process's monitors when it dies)."""
    async with open_supervisor(_specs(), FLAGS) as sup:
        watcher, target = await _refs(sup)
        baseline = len(target._cell.listeners)
        for _ in range(20):
            await watcher.ask(("monitor", target))
            await crash(watcher, sup)
        assert len(target._cell.listeners) == baseline


# -- links -------------------------------------------------------------------------------------


async def test_link_kills_both_ways() -> None:
    async with open_supervisor(_specs(), FLAGS) as sup:
        watcher, target = await _refs(sup)
        # target dies -> watcher dies
        await watcher.ask(("link", target))
        watcher_down = watcher.monitor()
        target_down = await crash(target)
        reason = (await watcher_down.wait()).reason
        assert isinstance(reason.error, LinkedExit)
        assert reason.error.ref == target
        assert reason.error.reason == target_down.reason
        assert reason.is_abnormal
        await sup.count_children()
        await wait_until(lambda: watcher.is_running and target.is_running)
        # watcher dies -> target dies
        await watcher.ask(("link", target))
        target_down_2 = target.monitor()
        await crash(watcher)
        reason = (await target_down_2.wait()).reason
        assert isinstance(reason.error, LinkedExit)
        assert reason.error.ref == watcher


async def test_linked_death_takes_the_exit_signal_reason() -> None:
    """OTP: a non-trapping process dies with the reason of the exit signal; so a linked actor
    killed by a ``shutdown`` exit is not restarted when transient."""
    specs = [ChildSpec("watcher", Watcher, restart=Restart.TRANSIENT), worker_spec("target")]
    async with open_supervisor(specs, FLAGS) as sup:
        watcher, target = await _refs(sup)
        await watcher.ask(("link", target))
        watcher_down = watcher.monitor()
        await exit_with(target, ExitReason.shutdown("bye"))
        reason = (await watcher_down.wait()).reason
        assert reason.kind == "shutdown"
        assert isinstance(reason.error, LinkedExit)
        await sup.count_children()
        assert not watcher.is_running  # transient + shutdown: not restarted
        assert watcher.statistics().incarnation == 1


async def test_normal_exit_does_not_propagate() -> None:
    async with open_supervisor(_specs(restart=Restart.TRANSIENT), FLAGS) as sup:
        watcher, target = await _refs(sup)
        await watcher.ask(("link", target))
        await exit_with(target, ExitReason.normal(), sup)
        assert await watcher.ask("ping") == "pong"
        assert watcher.statistics().incarnation == 1


async def test_trap_exits_turns_exits_into_messages() -> None:
    async with open_supervisor(_specs(Trapper), FLAGS) as sup:
        watcher, target = await _refs(sup)
        await watcher.ask(("link", target))
        down = await crash(target, sup)
        assert await watcher.ask("notices") == [Exit(target, down.reason)]
        assert watcher.statistics().incarnation == 1
        # OTP: a trapping process also gets {'EXIT', Pid, normal}.
        await wait_until(lambda: target.is_running)
        await watcher.ask(("link", target))
        await exit_with(target, ExitReason.normal(), sup)
        notices = await watcher.ask("notices")
        assert notices[-1] == Exit(target, ExitReason.normal())


async def test_link_is_one_incarnation() -> None:
    async with open_supervisor(_specs(Trapper), FLAGS) as sup:
        watcher, target = await _refs(sup)
        await watcher.ask(("link", target))
        await crash(target, sup)
        await crash(target, sup)  # the new incarnation was never linked
        assert len(await watcher.ask("notices")) == 1


async def test_links_of_a_dead_actor_are_dropped() -> None:
    async with open_supervisor(_specs(Trapper), FLAGS) as sup:
        watcher, target = await _refs(sup)
        baseline_target = len(target._cell.listeners)
        baseline_watcher = len(watcher._cell.listeners)
        for _ in range(10):
            await wait_until(lambda: target.is_running)
            await watcher.ask(("link", target))
            await crash(target, sup)
        assert len(target._cell.listeners) == baseline_target
        assert len(watcher._cell.listeners) == baseline_watcher
        for _ in range(10):
            await watcher.ask(("link", target))
            await exit_with(watcher, ExitReason.shutdown(), sup)
            await wait_until(lambda: watcher.is_running and target.is_running)
        assert len(target._cell.listeners) == baseline_target
