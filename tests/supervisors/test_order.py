"""OTP's order_of_children: children start in declared order and stop in reverse; a restarted
child keeps its place; dynamically added children come last; rest_for_one restarts in order."""

from __future__ import annotations

from supervisors import Strategy, SupervisorFlags, open_supervisor
from tests.helpers.supervision import Journal, crash, worker_spec

TAGS = [f"c{i}" for i in range(10)]


async def test_start_in_order_stop_in_reverse() -> None:
    journal = Journal()
    async with open_supervisor([worker_spec(t, journal) for t in TAGS]):
        assert journal.of("start") == TAGS
    assert journal.of("stop") == TAGS[::-1]


async def test_rest_for_one_partial_restart_then_full_shutdown() -> None:
    journal = Journal()
    flags = SupervisorFlags(Strategy.REST_FOR_ONE, intensity=10)
    tags = ["a", "b", "c", "d", "e"]
    async with open_supervisor([worker_spec(t, journal) for t in tags], flags) as sup:
        journal.clear()
        await crash(await sup.child("c"), sup)
        assert journal.events == [
            ("stop", "c"),
            ("stop", "e"),
            ("stop", "d"),
            ("start", "c"),
            ("start", "d"),
            ("start", "e"),
        ]
        journal.clear()
    assert journal.of("stop") == ["e", "d", "c", "b", "a"]


async def test_a_restarted_child_keeps_its_place() -> None:
    journal = Journal()
    flags = SupervisorFlags(intensity=10)
    async with open_supervisor([worker_spec(t, journal) for t in ("a", "b", "c")], flags) as sup:
        await crash(await sup.child("a"), sup)
        await crash(await sup.child("b"), sup)
        assert [c.id for c in await sup.which_children()] == ["a", "b", "c"]
        journal.clear()
    assert journal.of("stop") == ["c", "b", "a"]


async def test_added_children_come_last_and_stop_first() -> None:
    journal = Journal()
    async with open_supervisor([worker_spec(t, journal) for t in ("a", "b")]) as sup:
        await sup.start_child(worker_spec("late", journal))
        await sup.terminate_child("a")
        await sup.delete_child("a")
        await sup.start_child(worker_spec("a", journal))  # re-added: now last
        assert [c.id for c in await sup.which_children()] == ["b", "late", "a"]
        journal.clear()
    assert journal.of("stop") == ["a", "late", "b"]


async def test_one_for_all_restart_order_with_added_children() -> None:
    journal = Journal()
    flags = SupervisorFlags(Strategy.ONE_FOR_ALL, intensity=10)
    async with open_supervisor([worker_spec(t, journal) for t in ("a", "b")], flags) as sup:
        await sup.start_child(worker_spec("late", journal))
        journal.clear()
        await crash(await sup.child("b"), sup)
        assert journal.events == [
            ("stop", "b"),
            ("stop", "late"),
            ("stop", "a"),
            ("start", "a"),
            ("start", "b"),
            ("start", "late"),
        ]
