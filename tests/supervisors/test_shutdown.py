"""OTP's sup_stop group: shutdown specs (infinity, a timeout, brutal_kill), for static and dynamic
children, and the race where children exit on their own while their supervisor shuts down."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest

from actors import Actor, ActorRef, ExitReason, Monitor
from actors.testing import hang, wait_until
from supervisors import (
    ChildSpec,
    Restart,
    Strategy,
    Supervisor,
    SupervisorFlags,
    SupervisorRef,
    open_supervisor,
)
from tests.helpers.supervision import Boom, Journal, Worker, worker_spec

SIMPLE = SupervisorFlags(Strategy.SIMPLE_ONE_FOR_ONE, intensity=1000)


async def _monitors(sup: SupervisorRef) -> dict[str, Monitor]:
    return {info.id: info.ref.monitor() for info in await sup.which_children()}


async def _reasons(monitors: dict[str, Monitor]) -> dict[str, ExitReason]:
    return {key: (await m.wait()).reason for key, m in monitors.items()}


async def test_shutdown_timeout_kills_a_child_stuck_in_a_handler() -> None:
    """OTP: a child told to sleep ends ``killed``, the others ``shutdown``."""
    journal = Journal()
    specs = [worker_spec(tag, journal, shutdown=0.05) for tag in ("a", "sleeper", "c")]
    async with open_supervisor(specs) as sup:
        monitors = await _monitors(sup)
        await hang(await sup.child("sleeper"))
    reasons = await _reasons(monitors)
    assert reasons["a"] == reasons["c"] == ExitReason.shutdown()
    assert reasons["sleeper"] == ExitReason.killed("shutdown timeout")
    assert journal.of("stop") == ["c", "a"]  # the killed one ran no stopping hook


async def test_shutdown_infinity_waits_for_the_child() -> None:
    gate = anyio.Event()
    slow = Worker("slow", stopping_gate=gate)
    specs = [
        worker_spec("a", shutdown="infinity"),
        ChildSpec("slow", lambda: slow, shutdown="infinity"),
    ]

    async def open_gate_later() -> None:
        await wait_until(lambda: slow.stop_reasons != [])
        for _ in range(10):
            await anyio.lowlevel.checkpoint()
        gate.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(open_gate_later)
        async with open_supervisor(specs) as sup:
            monitors = await _monitors(sup)
    reasons = await _reasons(monitors)
    assert reasons == {"a": ExitReason.shutdown(), "slow": ExitReason.shutdown()}


async def test_brutal_kill() -> None:
    journal = Journal()
    specs = [worker_spec(tag, journal, shutdown="brutal_kill") for tag in ("a", "b")]
    async with open_supervisor(specs) as sup:
        monitors = await _monitors(sup)
    reasons = await _reasons(monitors)
    assert all(r.kind == "killed" for r in reasons.values())
    assert journal.of("stop") == []


@pytest.mark.parametrize("shutdown", ["brutal_kill", 0.05, "infinity"], ids=str)
async def test_dynamic_children_shutdown(shutdown: Any) -> None:
    journal = Journal()
    spec = ChildSpec("t", lambda tag: Worker(tag, journal), shutdown=shutdown)
    async with open_supervisor([spec], SIMPLE) as sup:
        refs = [await sup.start_dynamic(f"c{i}") for i in range(5)]
        monitors = {str(i): r.monitor() for i, r in enumerate(refs) if r is not None}
        if shutdown == 0.05:
            await hang(refs[2])  # type: ignore[arg-type]
    reasons = await _reasons(monitors)
    if shutdown == "brutal_kill":
        assert all(r.kind == "killed" for r in reasons.values())
    elif shutdown == 0.05:
        assert reasons.pop("2") == ExitReason.killed("shutdown timeout")
        assert set(reasons.values()) == {ExitReason.shutdown()}
    else:
        assert set(reasons.values()) == {ExitReason.shutdown()}


class Rendezvous(Actor):
    """Its ``stopping`` waits until every sibling is stopping too: only a parallel shutdown can
    end it with ``shutdown`` (a sequential one would reach the kill)."""

    def __init__(self, arrived: list[int], total: int, everyone: anyio.Event) -> None:
        self.arrived, self.total, self.everyone = arrived, total, everyone

    async def stopping(self, reason: ExitReason) -> None:
        self.arrived.append(1)
        if len(self.arrived) == self.total:
            self.everyone.set()
        await self.everyone.wait()


async def test_dynamic_children_stop_in_parallel() -> None:
    arrived: list[int] = []
    everyone = anyio.Event()
    spec = ChildSpec("r", lambda: Rendezvous(arrived, 20, everyone), shutdown=5)
    async with open_supervisor([spec], SIMPLE) as sup:
        refs = [await sup.start_dynamic() for _ in range(20)]
        monitors = {str(i): r.monitor() for i, r in enumerate(refs) if r is not None}
    reasons = await _reasons(monitors)
    assert set(reasons.values()) == {ExitReason.shutdown()}


async def test_child_supervisor_subtree_stops_in_order() -> None:
    journal = Journal()

    def inner() -> Supervisor:
        return Supervisor([worker_spec(t, journal) for t in ("x", "y")], name="inner")

    specs = [
        worker_spec("a", journal),
        ChildSpec("inner", inner, kind="supervisor"),
        worker_spec("b", journal),
    ]
    async with open_supervisor(specs):
        assert journal.of("start") == ["a", "x", "y", "b"]
    assert journal.of("stop") == ["b", "y", "x", "a"]


async def test_open_supervisor_shutdown_timeout_bounds_a_stuck_tree() -> None:
    specs = [worker_spec("stuck", shutdown="infinity")]
    async with open_supervisor(specs, shutdown_timeout=0.05) as sup:
        stuck = await sup.child("stuck")
        await hang(stuck)
        monitor = stuck.monitor()
        root = sup.ref.monitor()
    assert (await root.wait()).reason == ExitReason.killed("shutdown timeout")
    assert (await monitor.wait()).reason.kind == "killed"


# -- the race ---------------------------------------------------------------------------------

HOW = ["normal", "shutdown", "shutdown-detail", "killed", "error"]


class Racer(Actor):
    """Exits by itself, with its ``how``, as soon as ``go`` is set."""

    def __init__(self, how: str, go: anyio.Event) -> None:
        self.how, self.go = how, go

    async def started(self) -> None:
        self.start_soon(self._race)

    async def _race(self) -> None:
        await self.go.wait()
        match self.how:
            case "normal":
                self.stop(ExitReason.normal())
            case "shutdown":
                self.stop(ExitReason.shutdown())
            case "shutdown-detail":
                self.stop(ExitReason.shutdown("racing"))
            case "killed":
                self.stop(ExitReason.killed("racing"))
            case _:
                raise Boom("racing")


class Trigger(Actor):
    """Sets ``go`` from its own ``stopping``: the siblings then exit while the supervisor is in
    the middle of its shutdown."""

    def __init__(self, go: anyio.Event) -> None:
        self.go = go

    async def stopping(self, reason: ExitReason) -> None:
        self.go.set()
        for _ in range(5):
            await anyio.lowlevel.checkpoint()


def _racers(go: anyio.Event, copies: int) -> list[ChildSpec]:
    specs = []
    for restart in Restart:
        for how in HOW:
            for n in range(copies):
                specs.append(
                    ChildSpec(
                        f"{restart.value}-{how}-{n}",
                        lambda how=how: Racer(how, go),
                        restart=restart,
                    )
                )
    return specs


@pytest.mark.parametrize("when", ["go-then-stop", "go-yield-stop", "go-during-stop"])
async def test_children_exiting_on_their_own_while_the_supervisor_shuts_down(when: str) -> None:
    go = anyio.Event()
    specs = [*_racers(go, copies=3), ChildSpec("trigger", lambda: Trigger(go))]
    refs: list[ActorRef[Any]] = []
    async with open_supervisor(specs, SupervisorFlags(intensity=1000)) as sup:
        refs = [info.ref for info in await sup.which_children()]
        root = sup.ref.monitor()
        if when == "go-then-stop":
            go.set()
        elif when == "go-yield-stop":
            go.set()
            await anyio.lowlevel.checkpoint()
    # No restart, no hang, no leak (checked after the test), and a clean exit reason.
    assert (await root.wait()).reason == ExitReason.shutdown()
    assert all(ref.statistics().incarnation == 1 for ref in refs)
    assert all(ref.statistics().state == "dead" for ref in refs)


@pytest.mark.parametrize("when", ["go-then-stop", "go-yield-stop"])
async def test_dynamic_children_exiting_while_the_supervisor_shuts_down(when: str) -> None:
    flags = SupervisorFlags(Strategy.SIMPLE_ONE_FOR_ONE, intensity=1000)
    refs: list[ActorRef[Any]] = []
    for restart in Restart:
        go = anyio.Event()
        spec = ChildSpec("racer", lambda how, go=go: Racer(how, go), restart=restart)
        async with open_supervisor([spec], flags) as sup:
            for how in HOW * 3:
                ref = await sup.start_dynamic(how)
                assert ref is not None
                refs.append(ref)
            go.set()
            if when == "go-yield-stop":
                await anyio.lowlevel.checkpoint()
    assert all(ref.statistics().incarnation == 1 for ref in refs)
