"""Quarantine: a child that crash-loops is left down for a growing cooldown instead of taking its
supervisor (and so its siblings) down; on a VirtualClock, so cooldowns pass in microseconds."""

from __future__ import annotations

import pytest

from actors import VirtualClock
from actors.testing import wait_until
from supervisors import (
    METRICS_REGISTRY,
    InvalidChildSpec,
    Quarantine,
    Strategy,
    SupervisorFlags,
    open_supervisor,
)
from tests.helpers.supervision import StartControl, crash, states, worker_spec

POLICY = Quarantine(intensity=2, period=10, cooldown=5, max_cooldown=12)


async def _cooling(clock: VirtualClock) -> None:
    """Wait until the quarantine's timer sleeps on the clock: advancing it earlier is lost."""
    await wait_until(lambda: clock.sleepers >= 1)


def _quarantined(supervisor: str, child: str) -> float | None:
    return METRICS_REGISTRY.get_sample_value(
        "actorserve_supervisor_child_quarantined", {"supervisor": supervisor, "child": child}
    )


async def test_a_crash_looping_child_is_quarantined_and_its_sibling_never_restarts() -> None:
    clock = VirtualClock()
    flags = SupervisorFlags(intensity=1, period=10)  # the loop would escalate at once without it
    children = [worker_spec("looping", quarantine=POLICY), worker_spec("healthy")]
    async with open_supervisor(children, flags, clock=clock, name="pool-q1") as sup:
        looping, healthy = await sup.child("looping"), await sup.child("healthy")
        for _ in range(2):  # within the policy's intensity: restarted at once
            await crash(looping, sup)
        assert (await states(sup))["looping"] == "running"
        await crash(looping, sup)  # the third in the period: quarantined
        assert (await states(sup)) == {"looping": "quarantined", "healthy": "running"}
        assert _quarantined("pool-q1", "looping") == 1.0
        await _cooling(clock)
        clock.advance(4.9)
        assert (await states(sup))["looping"] == "quarantined"
        clock.advance(0.2)  # the cooldown is over: started again
        await wait_until(lambda: looping.statistics().restarts == 3)
        assert (await states(sup))["looping"] == "running"
        assert _quarantined("pool-q1", "looping") == 0.0
        assert healthy.statistics().restarts == 0
        assert (await sup.statistics()).restarts_in_window == 0  # nothing counted against it


async def test_the_cooldown_doubles_while_the_loop_goes_on_and_resets_after_a_quiet_period() -> (
    None
):
    clock = VirtualClock()
    async with open_supervisor(
        [worker_spec("looping", quarantine=POLICY)], clock=clock, name="pool-q2"
    ) as sup:
        looping = await sup.child("looping")
        for _ in range(3):
            await crash(looping, sup)
        await _cooling(clock)
        clock.advance(5.1)  # first cooldown: 5 s
        await wait_until(lambda: looping.statistics().restarts == 3)
        await crash(looping, sup)  # still inside the period: quarantined again, for 10 s
        assert (await states(sup))["looping"] == "quarantined"
        await _cooling(clock)
        clock.advance(9.9)
        assert (await states(sup))["looping"] == "quarantined"
        clock.advance(0.2)
        await wait_until(lambda: looping.statistics().restarts == 4)
        await crash(looping, sup)  # third: min(20, max_cooldown=12)
        await _cooling(clock)
        clock.advance(11.9)
        assert (await states(sup))["looping"] == "quarantined"
        clock.advance(0.2)
        await wait_until(lambda: looping.statistics().restarts == 5)
        assert (await states(sup))["looping"] == "running"  # the restart is complete
        clock.advance(10.5)  # up for a whole period: the next crash is a fresh start
        await crash(looping, sup)
        assert (await states(sup))["looping"] == "running"


async def test_a_child_that_cannot_start_is_quarantined_too() -> None:
    clock = VirtualClock()
    control = StartControl()
    spec = worker_spec("broken", control=control, quarantine=POLICY)
    async with open_supervisor([spec, worker_spec("healthy")], clock=clock) as sup:
        broken = await sup.child("broken")
        control.fail_always = True
        await crash(broken, sup)
        await wait_until(lambda: control.attempts >= 3)
        assert (await states(sup)) == {"broken": "quarantined", "healthy": "running"}
        control.fail_always = False
        await _cooling(clock)
        clock.advance(5.1)
        await wait_until(lambda: broken.statistics().restarts >= 1)
        assert (await states(sup))["broken"] == "running"


@pytest.mark.parametrize("strategy", [Strategy.ONE_FOR_ALL, Strategy.REST_FOR_ONE])
def test_quarantine_needs_a_one_for_one_supervisor(strategy: Strategy) -> None:
    from supervisors import Supervisor

    with pytest.raises(InvalidChildSpec, match="quarantine"):
        Supervisor([worker_spec("a", quarantine=POLICY)], SupervisorFlags(strategy=strategy))


def test_a_bad_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="cooldown"):
        Quarantine(cooldown=10, max_cooldown=5)
