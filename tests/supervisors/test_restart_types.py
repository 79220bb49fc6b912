"""OTP's normal_termination / shutdown_termination / abnormal_termination / temporary_bystander
cases: restart types x exit reasons."""

from __future__ import annotations

import pytest

from actors import ExitReason, VirtualClock
from supervisors import Restart, Strategy, SupervisorFlags, open_supervisor
from tests.helpers.supervision import Journal, crash, exit_with, states, worker_spec

REASONS = {
    "normal": ExitReason.normal(),
    "shutdown": ExitReason.shutdown(),
    "shutdown-detail": ExitReason.shutdown("done"),  # OTP's {shutdown, Term}
    "killed": ExitReason.killed("by itself"),
    "error": None,  # a real exception in a handler
}
RESTARTED = {
    Restart.PERMANENT: {"normal", "shutdown", "shutdown-detail", "killed", "error"},
    Restart.TRANSIENT: {"killed", "error"},
    Restart.TEMPORARY: set(),
}


@pytest.mark.parametrize("how", list(REASONS))
@pytest.mark.parametrize("restart", list(Restart), ids=lambda r: r.value)
async def test_restart_type_by_exit_reason(restart: Restart, how: str) -> None:
    spec = worker_spec("c", restart=restart)
    flags = SupervisorFlags(intensity=10)
    async with open_supervisor([spec, worker_spec("other")], flags, clock=VirtualClock()) as sup:
        ref = await sup.child("c")
        reason = REASONS[how]
        down = await (crash(ref, sup) if reason is None else exit_with(ref, reason, sup))
        assert down.reason.is_abnormal == (how in ("killed", "error"))
        stats = await sup.statistics()
        if how in RESTARTED[restart]:
            assert ref.is_running and ref.statistics().incarnation == 2
            assert await states(sup) == {"c": "running", "other": "running"}
            assert stats.restarts == 1
        elif restart is Restart.TEMPORARY:
            assert not ref.is_running
            assert await states(sup) == {"other": "running"}  # forgotten
            assert stats.restarts == 0
        else:
            assert not ref.is_running and ref.statistics().state == "dead"
            assert await states(sup) == {"c": "undefined", "other": "running"}  # kept
            assert stats.restarts == 0
        assert (await sup.child("other")).statistics().incarnation == 1


@pytest.mark.parametrize("strategy", [Strategy.ONE_FOR_ALL, Strategy.REST_FOR_ONE], ids=str)
async def test_temporary_bystander_is_not_restarted_and_forgotten(strategy: Strategy) -> None:
    journal = Journal()
    specs = [
        worker_spec("a", journal),
        worker_spec("temp", journal, restart=Restart.TEMPORARY),
        worker_spec("trans", journal, restart=Restart.TRANSIENT),
        worker_spec("c", journal),
    ]
    async with open_supervisor(specs, SupervisorFlags(strategy, intensity=10)) as sup:
        temp = await sup.child("temp")
        await crash(await sup.child("a"), sup)
        assert not temp.is_running
        assert await states(sup) == {"a": "running", "trans": "running", "c": "running"}
        # The transient bystander was terminated with shutdown and still restarted: OTP restarts
        # every non-temporary sibling in a group restart.
        assert (await sup.child("trans")).statistics().incarnation == 2
    assert journal.of("start") == ["a", "temp", "trans", "c", "a", "trans", "c"]


async def test_temporary_child_before_the_failed_one_is_untouched_by_rest_for_one() -> None:
    specs = [worker_spec("temp", restart=Restart.TEMPORARY), worker_spec("a"), worker_spec("b")]
    async with open_supervisor(specs, SupervisorFlags(Strategy.REST_FOR_ONE, intensity=10)) as sup:
        await crash(await sup.child("a"), sup)
        assert await states(sup) == {"temp": "running", "a": "running", "b": "running"}
        assert (await sup.child("temp")).statistics().incarnation == 1


@pytest.mark.parametrize("strategy", [Strategy.ONE_FOR_ALL, Strategy.REST_FOR_ONE], ids=str)
async def test_not_restarted_exits_do_not_trigger_group_restarts(strategy: Strategy) -> None:
    specs = [
        worker_spec("t", restart=Restart.TRANSIENT),
        worker_spec("tmp", restart=Restart.TEMPORARY),
        worker_spec("b"),
    ]
    async with open_supervisor(specs, SupervisorFlags(strategy, intensity=10)) as sup:
        b = await sup.child("b")
        await exit_with(await sup.child("t"), ExitReason.normal(), sup)
        await crash(await sup.child("tmp"), sup)
        assert b.statistics().incarnation == 1
        assert await states(sup) == {"t": "undefined", "b": "running"}
