"""OTP's tree group: nested supervisors start and stop as a whole, a crashing child supervisor
takes its subtree down in order and comes back with it, a killed one leaves nothing behind."""

from __future__ import annotations

from typing import Any

import pytest

from actors import ExitReason
from supervisors import (
    ChildCount,
    ChildSpec,
    ChildStartFailed,
    Strategy,
    Supervisor,
    SupervisorFlags,
    SupervisorRef,
    open_supervisor,
    snapshot_tree,
)
from tests.helpers.supervision import Journal, StartControl, crash, states, worker_spec

FLAGS = SupervisorFlags(intensity=10)


def _tree(journal: Journal, **inner_spec: Any) -> list[ChildSpec]:
    """root: a, mid (one_for_all: x, leaf (one_for_one: p, q)), b"""

    def leaf() -> Supervisor:
        return Supervisor([worker_spec(t, journal) for t in ("p", "q")], FLAGS, name="leaf")

    def mid() -> Supervisor:
        children = [worker_spec("x", journal), ChildSpec("leaf", leaf, kind="supervisor")]
        return Supervisor(children, SupervisorFlags(Strategy.ONE_FOR_ALL, intensity=10), name="mid")

    return [
        worker_spec("a", journal),
        ChildSpec("mid", mid, kind="supervisor", **inner_spec),
        worker_spec("b", journal),
    ]


async def _sub(sup: SupervisorRef, *path: str) -> SupervisorRef:
    for child_id in path:
        sup = SupervisorRef(await sup.child(child_id))
    return sup


async def test_a_tree_starts_and_stops_as_a_whole() -> None:
    journal = Journal()
    async with open_supervisor(_tree(journal), FLAGS) as root:
        assert journal.of("start") == ["a", "x", "p", "q", "b"]
        assert await root.count_children() == ChildCount(3, 3, 1, 2)
        leaf = await _sub(root, "mid", "leaf")
        assert await states(leaf) == {"p": "running", "q": "running"}
        assert (await leaf.statistics()).name == "leaf"
    assert journal.of("stop") == ["b", "q", "p", "x", "a"]


async def test_a_crash_deep_down_is_handled_at_its_level() -> None:
    journal = Journal()
    async with open_supervisor(_tree(journal), FLAGS) as root:
        leaf = await _sub(root, "mid", "leaf")
        journal.clear()
        await crash(await leaf.child("p"), leaf)
        assert journal.events == [("stop", "p"), ("start", "p")]
        assert (await root.child("mid")).statistics().incarnation == 1


async def test_a_crashing_child_supervisor_restarts_with_its_subtree() -> None:
    journal = Journal()
    async with open_supervisor(_tree(journal), FLAGS) as root:
        mid_ref = await root.child("mid")
        old_p = await (await _sub(root, "mid", "leaf")).child("p")
        p_down = old_p.monitor()
        journal.clear()
        down = await crash(mid_ref, root)  # a real exception in the supervisor itself
        assert down.reason.is_abnormal
        # As in OTP, where the crash reaches the children as an exit signal through their
        # links, the subtree dies with it (no ordered shutdown, no stopping hooks)...
        assert (await p_down.wait()).reason.kind == "killed"
        # ...and the new incarnation starts it again, in order.
        assert journal.events == [("start", "x"), ("start", "p"), ("start", "q")]
        assert mid_ref.statistics().incarnation == 2
        leaf = await _sub(root, "mid", "leaf")
        assert await (await leaf.child("q")).ask("ping") == "pong"


async def test_a_killed_child_supervisor_takes_its_subtree_with_it() -> None:
    journal = Journal()
    async with open_supervisor(_tree(journal, shutdown="brutal_kill"), FLAGS) as root:
        leaf = await _sub(root, "mid", "leaf")
        p = await leaf.child("p")
        mid = await root.child("mid")
        p_down, mid_down = p.monitor(), mid.monitor()
        journal.clear()
        await root.terminate_child("mid")
        assert (await mid_down.wait()).reason.kind == "killed"
        assert (await p_down.wait()).reason.kind == "killed"  # nothing orphaned
        assert journal.events == []  # killed: no stopping hook anywhere below
        await root.restart_child("mid")
        assert journal.of("start") == ["x", "p", "q"]
        assert await states(root) == {"a": "running", "mid": "running", "b": "running"}


async def test_grandchildren_of_a_one_for_all_group_restart() -> None:
    journal = Journal()
    async with open_supervisor(_tree(journal), FLAGS) as root:
        mid = await _sub(root, "mid")
        journal.clear()
        await crash(await mid.child("x"), mid)
        # one_for_all in mid: the leaf supervisor (and its children) restart too.
        assert journal.events == [
            ("stop", "x"),
            ("stop", "q"),
            ("stop", "p"),
            ("start", "x"),
            ("start", "p"),
            ("start", "q"),
        ]


async def test_a_supervisor_stopped_by_its_parent_exits_with_shutdown() -> None:
    journal = Journal()
    async with open_supervisor(_tree(journal), FLAGS) as root:
        mid = await root.child("mid")
        monitor = mid.monitor()
        await root.terminate_child("mid")
        assert (await monitor.wait()).reason == ExitReason.shutdown()
        assert journal.of("stop") == ["q", "p", "x"]


async def test_a_child_supervisor_added_at_run_time_is_in_the_tree_until_deleted() -> None:
    # A pool that scales: a worker supervisor started with start_child, later terminated and
    # deleted; one whose own child fails to start leaves no trace, and its id can be used again.
    journal = Journal()
    control = StartControl(fail=1)

    def pool_member() -> Supervisor:
        return Supervisor([worker_spec("e", journal, control)], FLAGS, name="member")

    async with open_supervisor(_tree(journal), FLAGS) as root:
        leaf = await _sub(root, "mid", "leaf")
        member = ChildSpec("member", pool_member, kind="supervisor")
        with pytest.raises(ChildStartFailed):
            await leaf.start_child(member)
        assert [c.id for c in await leaf.which_children()] == ["p", "q"]
        assert await leaf.start_child(member) is not None
        tree = await snapshot_tree(root)
        (mid,) = [n for n in tree.children if n.id == "mid"]
        (leaf_node,) = [n for n in mid.children if n.id == "leaf"]
        assert [(n.id, n.kind, n.state) for n in leaf_node.children] == [
            ("p", "worker", "running"),
            ("q", "worker", "running"),
            ("member", "supervisor", "running"),
        ]
        assert [n.id for n in leaf_node.children[2].children] == ["e"]
        await leaf.terminate_child("member")
        await leaf.delete_child("member")
        assert [c.id for c in await leaf.which_children()] == ["p", "q"]
        assert journal.of("stop")[-1:] == ["e"]
