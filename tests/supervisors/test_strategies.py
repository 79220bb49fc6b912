"""OTP's restart_one_for_one / restart_one_for_all / restart_rest_for_one /
restart_simple_one_for_one groups: base cases, escalation when the intensity is exceeded, a
sibling failing to start during a group restart, ignore during a restart."""

from __future__ import annotations

import pytest

from actors import ExitReason, VirtualClock
from supervisors import (
    ChildSpec,
    Restart,
    Strategy,
    Supervisor,
    SupervisorExited,
    SupervisorFlags,
    SupervisorRef,
    open_supervisor,
)
from tests.helpers.supervision import Journal, StartControl, Worker, crash, states, worker_spec

ESCALATED = ExitReason.shutdown("reached_max_restart_intensity")


def _specs(
    journal: Journal, *tags: str, control: dict[str, StartControl] | None = None
) -> list[ChildSpec]:
    control = control or {}
    return [worker_spec(tag, journal, control.get(tag)) for tag in tags]


async def test_one_for_one() -> None:
    journal = Journal()
    flags = SupervisorFlags(Strategy.ONE_FOR_ONE, intensity=10)
    async with open_supervisor(_specs(journal, "a", "b", "c"), flags) as sup:
        journal.clear()
        await crash(await sup.child("b"), sup)
        assert journal.events == [("stop", "b"), ("start", "b")]
        assert [(await sup.child(t)).statistics().incarnation for t in "abc"] == [1, 2, 1]


async def test_one_for_all() -> None:
    journal = Journal()
    flags = SupervisorFlags(Strategy.ONE_FOR_ALL, intensity=10)
    async with open_supervisor(_specs(journal, "a", "b", "c"), flags) as sup:
        journal.clear()
        await crash(await sup.child("b"), sup)
        # b's own stopping runs as it crashes; the others stop in reverse order, then every
        # child starts again in order.
        assert journal.events == [
            ("stop", "b"),
            ("stop", "c"),
            ("stop", "a"),
            ("start", "a"),
            ("start", "b"),
            ("start", "c"),
        ]
        assert [(await sup.child(t)).statistics().incarnation for t in "abc"] == [2, 2, 2]
        assert (await sup.statistics()).restarts == 1  # one restart, however many children


async def test_rest_for_one() -> None:
    journal = Journal()
    flags = SupervisorFlags(Strategy.REST_FOR_ONE, intensity=10)
    async with open_supervisor(_specs(journal, "a", "b", "c", "d"), flags) as sup:
        journal.clear()
        await crash(await sup.child("b"), sup)
        assert journal.events == [
            ("stop", "b"),
            ("stop", "d"),
            ("stop", "c"),
            ("start", "b"),
            ("start", "c"),
            ("start", "d"),
        ]
        assert [(await sup.child(t)).statistics().incarnation for t in "abcd"] == [1, 2, 2, 2]
        journal.clear()
        await crash(await sup.child("d"), sup)  # the last child: only itself
        assert journal.events == [("stop", "d"), ("start", "d")]


async def test_simple_one_for_one() -> None:
    flags = SupervisorFlags(Strategy.SIMPLE_ONE_FOR_ONE, intensity=10)
    async with open_supervisor([ChildSpec("t", lambda: Worker("t"))], flags) as sup:
        refs = [await sup.start_dynamic() for _ in range(3)]
        await crash(refs[1], sup)  # type: ignore[arg-type]
        assert [r.statistics().incarnation for r in refs if r is not None] == [1, 2, 1]
        assert [c.ref for c in await sup.which_children()] == refs


@pytest.mark.parametrize("strategy", list(Strategy), ids=lambda s: s.value)
async def test_escalation_when_the_intensity_is_exceeded(strategy: Strategy) -> None:
    journal = Journal()
    flags = SupervisorFlags(strategy, intensity=2, period=10)
    if strategy is Strategy.SIMPLE_ONE_FOR_ONE:
        specs = [ChildSpec("t", lambda tag: Worker(tag, journal))]
    else:
        specs = _specs(journal, "a", "b", "c")
    with pytest.raises(SupervisorExited) as info:
        async with open_supervisor(specs, flags, clock=VirtualClock(), name="top") as sup:
            if strategy is Strategy.SIMPLE_ONE_FOR_ONE:
                for tag in "abc":
                    await sup.start_dynamic(tag)
            victim = await sup.child((await sup.which_children())[0].id)
            await crash(victim, sup)
            await crash(victim, sup)
            assert (await sup.statistics()).restarts_in_window == 2
            monitor = sup.ref.monitor()
            await crash(victim)  # the third restart within the period is one too many
            assert (await monitor.wait()).reason == ESCALATED
            await anyio_sleep_forever()
    assert info.value.name == "top"
    assert info.value.reason == ESCALATED
    assert not info.value.reason.is_abnormal  # OTP: the supervisor exits with shutdown
    # Every child was stopped (and none is left running).
    assert journal.of("start").count("a") == journal.of("stop").count("a")
    if strategy is not Strategy.SIMPLE_ONE_FOR_ONE:
        assert journal.events[-2:] == [("stop", "c"), ("stop", "b")]


async def test_intensity_zero_escalates_on_the_first_restart() -> None:
    flags = SupervisorFlags(intensity=0)
    with pytest.raises(SupervisorExited):
        async with open_supervisor([worker_spec("a")], flags) as sup:
            await crash(await sup.child("a"))
            await anyio_sleep_forever()


async def test_not_restarted_exits_do_not_count() -> None:
    flags = SupervisorFlags(intensity=0)
    specs = [
        worker_spec("t", restart=Restart.TRANSIENT),
        worker_spec("tmp", restart=Restart.TEMPORARY),
    ]
    async with open_supervisor(specs, flags) as sup:
        await crash(await sup.child("tmp"), sup)
        from tests.helpers.supervision import exit_with

        await exit_with(await sup.child("t"), ExitReason.normal(), sup)
        assert (await sup.statistics()).restarts == 0


def _inner(journal: Journal, intensity: int = 0) -> Supervisor:
    return Supervisor(
        [worker_spec("x", journal)], SupervisorFlags(intensity=intensity), name="inner"
    )


async def test_nested_escalation_restarts_the_child_supervisor() -> None:
    journal = Journal()
    specs = [
        worker_spec("a", journal),
        ChildSpec("inner", lambda: _inner(journal), kind="supervisor"),
    ]
    async with open_supervisor(specs, SupervisorFlags(intensity=5), clock=VirtualClock()) as sup:
        inner_ref = await sup.child("inner")
        inner = SupervisorRef(inner_ref)
        x = await inner.child("x")
        gives_up = inner_ref.monitor()
        await crash(x)  # intensity 0: the child supervisor gives up...
        assert (await gives_up.wait()).reason == ESCALATED
        await sup.count_children()
        # ...and its parent restarts it, with a fresh child.
        assert inner_ref.is_running and inner_ref.statistics().incarnation == 2
        assert not x.is_running
        x2 = await inner.child("x")
        assert x2 != x and await x2.ask("ping") == "pong"
        assert (await sup.child("a")).statistics().incarnation == 1
        assert journal.of("start") == ["a", "x", "x"]


async def test_nested_escalation_of_a_transient_child_supervisor() -> None:
    """OTP: a supervisor giving up exits with ``shutdown``, which a transient parent spec does
    not restart."""
    journal = Journal()
    specs = [
        ChildSpec("inner", lambda: _inner(journal), kind="supervisor", restart=Restart.TRANSIENT)
    ]
    async with open_supervisor(specs, SupervisorFlags(intensity=5)) as sup:
        inner_ref = await sup.child("inner")
        monitor = inner_ref.monitor()
        await crash(await SupervisorRef(inner_ref).child("x"))
        assert (await monitor.wait()).reason == ESCALATED
        await sup.count_children()
        assert await states(sup) == {"inner": "undefined"}


async def test_escalation_climbs_until_a_level_absorbs_it() -> None:
    journal = Journal()

    def middle() -> Supervisor:
        spec = ChildSpec("inner", lambda: _inner(journal), kind="supervisor")
        return Supervisor([spec], SupervisorFlags(intensity=0), name="middle")

    specs = [ChildSpec("middle", middle, kind="supervisor")]
    async with open_supervisor(specs, SupervisorFlags(intensity=3)) as sup:
        middle_ref = await sup.child("middle")
        inner_ref = await SupervisorRef(middle_ref).child("inner")
        middle_gives_up = middle_ref.monitor()
        await crash(await SupervisorRef(inner_ref).child("x"))
        assert (await middle_gives_up.wait()).reason == ESCALATED
        await sup.count_children()
        assert middle_ref.statistics().incarnation == 2
        assert (await sup.statistics()).restarts == 1
        assert journal.of("start") == ["x", "x"]


@pytest.mark.parametrize("strategy", [Strategy.ONE_FOR_ALL, Strategy.REST_FOR_ONE], ids=str)
async def test_a_sibling_fails_to_start_during_a_group_restart(strategy: Strategy) -> None:
    journal = Journal()
    control = {"b": StartControl()}
    flags = SupervisorFlags(strategy, intensity=5)
    async with open_supervisor(_specs(journal, "a", "b", "c", control=control), flags) as sup:
        journal.clear()
        control["b"].fail = 1
        await crash(await sup.child("a"), sup)
        await sup.count_children()  # the retry is a message of its own
        # a restarts, b fails, so a is terminated again; the group is retried as a whole.
        assert journal.events == [
            ("stop", "a"),
            ("stop", "c"),
            ("stop", "b"),
            ("start", "a"),
            ("start_failed", "b"),
            ("stop", "a"),
            ("start", "a"),
            ("start", "b"),
            ("start", "c"),
        ]
        assert await states(sup) == {"a": "running", "b": "running", "c": "running"}
        assert (await sup.statistics()).restarts == 2  # the failed restart counted too


async def test_failing_group_restart_escalates() -> None:
    journal = Journal()
    control = {"b": StartControl()}
    flags = SupervisorFlags(Strategy.ONE_FOR_ALL, intensity=3)
    with pytest.raises(SupervisorExited) as info:
        async with open_supervisor(_specs(journal, "a", "b", "c", control=control), flags) as sup:
            control["b"].fail_always = True
            await crash(await sup.child("a"))
            await anyio_sleep_forever()
    assert info.value.reason == ESCALATED
    assert journal.of("start").count("a") == journal.of("stop").count("a")


async def test_ignore_during_a_restart() -> None:
    journal = Journal()
    control = {"a": StartControl()}
    flags = SupervisorFlags(Strategy.ONE_FOR_ALL, intensity=5)
    async with open_supervisor(_specs(journal, "a", "b", control=control), flags) as sup:
        control["a"].ignore = 1
        await crash(await sup.child("a"), sup)
        assert await states(sup) == {"a": "undefined", "b": "running"}
        assert (await sup.child("b")).statistics().incarnation == 2


async def anyio_sleep_forever() -> None:
    import anyio

    await anyio.sleep_forever()
