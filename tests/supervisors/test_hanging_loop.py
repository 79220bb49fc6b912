"""OTP's hanging_restart_loop cases: a child whose restart keeps failing (intensity high enough
never to give up) leaves the supervisor responsive, ``restarting`` visible, and stoppable."""

from __future__ import annotations

import pytest

from actors import VirtualClock
from supervisors import (
    ChildRestarting,
    ChildSpec,
    Strategy,
    SupervisorFlags,
    open_supervisor,
)
from tests.helpers.supervision import Journal, StartControl, Worker, crash, states, worker_spec

LOOPING = 10**9  # an intensity the loop never reaches


@pytest.mark.parametrize(
    "strategy",
    [Strategy.ONE_FOR_ONE, Strategy.ONE_FOR_ALL, Strategy.REST_FOR_ONE],
    ids=lambda s: s.value,
)
async def test_hanging_restart_loop(strategy: Strategy) -> None:
    control = StartControl()
    journal = Journal()
    specs = [worker_spec("a", journal, control), worker_spec("b", journal)]
    flags = SupervisorFlags(strategy, intensity=LOOPING, period=1)
    async with open_supervisor(specs, flags, clock=VirtualClock()) as sup:
        control.fail_always = True
        await crash(await sup.child("a"))
        # The supervisor answers between attempts, and shows the child restarting.
        for _ in range(3):
            assert (await states(sup))["a"] == "restarting"
        attempts = control.attempts
        assert attempts >= 1
        with pytest.raises(ChildRestarting):
            await sup.restart_child("a")
        with pytest.raises(ChildRestarting):
            await sup.delete_child("a")
        stats = await sup.statistics()
        assert stats.restarts >= 2
        assert control.attempts > attempts  # still looping meanwhile
        # terminate_child ends the loop (OTP: the child becomes undefined).
        await sup.terminate_child("a")
        assert (await states(sup))["a"] == "undefined"
        stopped_at = control.attempts
        await sup.count_children()
        await sup.count_children()
        assert control.attempts == stopped_at
        control.fail_always = False
        ref = await sup.restart_child("a")
        assert ref is not None and await ref.ask("ping") == "pong"


async def test_a_looping_supervisor_can_be_stopped() -> None:
    control = StartControl()
    journal = Journal()
    specs = [worker_spec("b", journal), worker_spec("a", journal, control)]
    flags = SupervisorFlags(intensity=LOOPING, period=1)
    async with open_supervisor(specs, flags, clock=VirtualClock()) as sup:
        control.fail_always = True
        await crash(await sup.child("a"))
        await states(sup)
    # Stopped cleanly while looping: b stopped, nothing left running (the leak check agrees).
    assert journal.of("stop")[-1] == "b"


async def test_a_looping_simple_one_for_one_child() -> None:
    control = StartControl()
    flags = SupervisorFlags(Strategy.SIMPLE_ONE_FOR_ONE, intensity=LOOPING, period=1)
    spec = ChildSpec("t", lambda: Worker("t", None, control))
    async with open_supervisor([spec], flags, clock=VirtualClock()) as sup:
        ref = await sup.start_dynamic()
        assert ref is not None
        control.fail_always = True
        await crash(ref)
        assert [c.state for c in await sup.which_children()] == ["restarting"]
        await sup.terminate_child(ref)
        assert await sup.which_children() == []
