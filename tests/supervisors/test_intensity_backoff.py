"""Restart intensity over time (OTP's multiple_restarts) and restart backoff, both on a
VirtualClock: no real sleeping, hours of history in microseconds."""

from __future__ import annotations

import itertools

import pytest

from actors import ActorRestarting, ExitReason, VirtualClock, WhileRestarting
from actors.testing import wait_until
from supervisors import (
    METRICS_REGISTRY,
    Backoff,
    Strategy,
    SupervisorExited,
    SupervisorFlags,
    SupervisorRef,
    open_supervisor,
)
from tests.helpers.supervision import Journal, StartControl, crash, states, worker_spec

ESCALATED = ExitReason.shutdown("reached_max_restart_intensity")
_names = itertools.count()


async def _forever() -> None:
    import anyio

    await anyio.sleep_forever()


# -- intensity ---------------------------------------------------------------------------------


async def test_crashes_spaced_beyond_the_period_survive() -> None:
    clock = VirtualClock()
    flags = SupervisorFlags(intensity=1, period=10)
    async with open_supervisor([worker_spec("a")], flags, clock=clock) as sup:
        ref = await sup.child("a")
        for _ in range(25):
            await crash(ref, sup)
            clock.advance(10.001)
        assert ref.statistics().restarts == 25
        stats = await sup.statistics()
        assert (stats.restarts, stats.restarts_in_window) == (25, 0)


async def test_a_burst_within_the_intensity_survives() -> None:
    clock = VirtualClock()
    flags = SupervisorFlags(intensity=3, period=10)
    async with open_supervisor([worker_spec("a")], flags, clock=clock) as sup:
        ref = await sup.child("a")
        for _ in range(3):
            await crash(ref, sup)
        assert (await sup.statistics()).restarts_in_window == 3
        clock.advance(10.5)  # the window empties...
        for _ in range(3):  # ...and allows another burst
            await crash(ref, sup)
        assert ref.statistics().restarts == 6


async def test_the_sustained_rate_matters_not_only_the_spacing() -> None:
    """Two restarts per period with intensity 2 survive; a third inside the window does not."""
    clock = VirtualClock()
    flags = SupervisorFlags(intensity=2, period=10)
    with pytest.raises(SupervisorExited) as info:
        async with open_supervisor([worker_spec("a")], flags, clock=clock) as sup:
            ref = await sup.child("a")
            for _ in range(4):  # restarts at 0, 6, 12, 18: at most 2 in any 10 s
                await crash(ref, sup)
                clock.advance(6)
            assert ref.statistics().restarts == 4
            # now 24: the restarts at 18 and 24 are in the window, so one at 27 is a third
            await crash(ref, sup)
            clock.advance(3)
            await crash(ref)
            await _forever()
    assert info.value.reason == ESCALATED


async def test_the_period_boundary_is_inclusive_as_in_otp() -> None:
    clock = VirtualClock()
    flags = SupervisorFlags(intensity=1, period=10)
    with pytest.raises(SupervisorExited):
        async with open_supervisor([worker_spec("a")], flags, clock=clock) as sup:
            ref = await sup.child("a")
            await crash(ref, sup)
            clock.advance(10)  # exactly one period later: still inside it
            await crash(ref)
            await _forever()


async def test_each_supervisor_counts_its_own_restarts() -> None:
    clock = VirtualClock()
    flags = SupervisorFlags(intensity=1, period=10)
    specs = [worker_spec("a"), worker_spec("b")]
    with pytest.raises(SupervisorExited):
        async with open_supervisor(specs, flags, clock=clock) as sup:
            await crash(await sup.child("a"), sup)  # different children share the budget
            await crash(await sup.child("b"))
            await _forever()


# -- backoff -----------------------------------------------------------------------------------


async def _crash_and_restart(ref_sup: tuple[object, SupervisorRef], clock: VirtualClock) -> float:
    """Crash, wait for the backoff timer, jump the clock over it; return the delay."""
    ref, sup = ref_sup
    await crash(ref, sup)  # type: ignore[arg-type]
    await wait_until(lambda: clock.sleepers == 1)
    delay = clock.slept[-1]
    assert (await states(sup))["a"] == "restarting"
    clock.advance(delay)
    await wait_until(lambda: ref.is_running)  # type: ignore[attr-defined]
    await sup.count_children()  # the supervisor has recorded the start
    return delay


async def test_backoff_grows_from_min_to_max() -> None:
    clock = VirtualClock()
    backoff = Backoff(min_delay=1, max_delay=8, multiplier=2, jitter=0, reset_after=1000)
    flags = SupervisorFlags(intensity=100, period=1)
    async with open_supervisor([worker_spec("a", backoff=backoff)], flags, clock=clock) as sup:
        ref = await sup.child("a")
        delays = [await _crash_and_restart((ref, sup), clock) for _ in range(6)]
        assert delays == [1, 2, 4, 8, 8, 8]
        assert ref.statistics().restarts == 6


async def test_backoff_jitter_stays_within_bounds() -> None:
    clock = VirtualClock()
    backoff = Backoff(min_delay=2, max_delay=2, jitter=0.5, reset_after=1000)
    flags = SupervisorFlags(intensity=100, period=1)
    async with open_supervisor([worker_spec("a", backoff=backoff)], flags, clock=clock) as sup:
        ref = await sup.child("a")
        delays = [await _crash_and_restart((ref, sup), clock) for _ in range(12)]
        assert all(1.0 <= d <= 3.0 for d in delays)
        assert len(set(delays)) > 1  # it is jittered


async def test_backoff_resets_after_a_healthy_period() -> None:
    clock = VirtualClock()
    backoff = Backoff(min_delay=1, max_delay=60, multiplier=3, jitter=0, reset_after=30)
    flags = SupervisorFlags(intensity=100, period=1)
    async with open_supervisor([worker_spec("a", backoff=backoff)], flags, clock=clock) as sup:
        ref = await sup.child("a")
        assert [await _crash_and_restart((ref, sup), clock) for _ in range(3)] == [1, 3, 9]
        clock.advance(29)  # not healthy long enough
        assert await _crash_and_restart((ref, sup), clock) == 27
        clock.advance(30)  # ran 30 s: the next delay starts over
        assert await _crash_and_restart((ref, sup), clock) == 1
        assert await _crash_and_restart((ref, sup), clock) == 3


async def test_failed_restarts_back_off_too() -> None:
    """A child that dies at start (a GPU engine failing to load) must not hot-loop."""
    clock = VirtualClock()
    control = StartControl()
    backoff = Backoff(min_delay=1, max_delay=100, multiplier=2, jitter=0, reset_after=1000)
    flags = SupervisorFlags(intensity=100, period=1)
    spec = worker_spec("a", control=control, backoff=backoff)
    async with open_supervisor([spec], flags, clock=clock) as sup:
        ref = await sup.child("a")
        control.fail_always = True
        await crash(ref, sup)
        for expected in (1, 2, 4, 8):
            await wait_until(lambda: clock.sleepers == 1)
            assert clock.slept[-1] == expected
            attempts = control.attempts
            clock.advance(expected)
            await wait_until(lambda n=attempts: control.attempts == n + 1)
        control.fail_always = False
        await wait_until(lambda: clock.sleepers == 1)
        clock.advance(clock.slept[-1])
        await wait_until(lambda: ref.is_running)
        assert await ref.ask("ping") == "pong"


async def test_calls_during_backoff_follow_the_policy() -> None:
    clock = VirtualClock()
    backoff = Backoff(min_delay=5, max_delay=5, jitter=0)
    specs = [
        worker_spec("fail", backoff=backoff),
        worker_spec("wait", backoff=backoff, while_restarting=WhileRestarting("wait", 60)),
    ]
    async with open_supervisor(specs, SupervisorFlags(intensity=10), clock=clock) as sup:
        failing, waiting = await sup.child("fail"), await sup.child("wait")
        await crash(failing, sup)
        await crash(waiting, sup)
        with pytest.raises(ActorRestarting):
            await failing.ask("ping")
        import anyio

        async with anyio.create_task_group() as tg:

            async def call() -> None:
                assert await waiting.ask("ping") == "pong"

            tg.start_soon(call)
            await wait_until(lambda: clock.sleepers == 2)
            clock.advance(5)
        assert await failing.ask("ping") == "pong"


async def test_group_restart_waits_for_the_backoff() -> None:
    clock = VirtualClock()
    journal = Journal()
    backoff = Backoff(min_delay=5, max_delay=5, jitter=0)
    specs = [worker_spec("a", journal, backoff=backoff), worker_spec("b", journal)]
    flags = SupervisorFlags(Strategy.ONE_FOR_ALL, intensity=10)
    async with open_supervisor(specs, flags, clock=clock) as sup:
        journal.clear()
        await crash(await sup.child("a"), sup)
        assert await states(sup) == {"a": "restarting", "b": "restarting"}
        with pytest.raises(ActorRestarting):
            await (await sup.child("b")).ask("ping")
        await wait_until(lambda: clock.sleepers == 1)
        clock.advance(5)
        await wait_until(lambda: journal.of("start") == ["a", "b"])
        assert journal.events == [("stop", "a"), ("stop", "b"), ("start", "a"), ("start", "b")]


async def test_stopping_during_a_backoff() -> None:
    clock = VirtualClock()
    backoff = Backoff(min_delay=100, max_delay=100, jitter=0)
    async with open_supervisor([worker_spec("a", backoff=backoff)], clock=clock) as sup:
        ref = await sup.child("a")
        await crash(ref, sup)
        await wait_until(lambda: clock.sleepers == 1)
    assert ref.statistics().state == "dead"  # the pending restart was dropped, nothing leaked


async def test_backoff_gauge() -> None:
    clock = VirtualClock()
    backoff = Backoff(min_delay=7, max_delay=7, jitter=0)
    name = f"backoff-gauge-{next(_names)}"  # metrics are process-wide: a fresh label set
    labels = {"supervisor": name, "child": "a"}
    async with open_supervisor([worker_spec("a", backoff=backoff)], clock=clock, name=name) as sup:
        ref = await sup.child("a")
        await crash(ref, sup)
        gauge = "actorserve_supervisor_backoff_seconds"
        assert METRICS_REGISTRY.get_sample_value(gauge, labels) == 7
        await wait_until(lambda: clock.sleepers == 1)
        clock.advance(7)
        await wait_until(lambda: ref.is_running)
        await sup.count_children()
        assert METRICS_REGISTRY.get_sample_value(gauge, labels) == 0
        events = "actorserve_supervisor_events_total"
        assert METRICS_REGISTRY.get_sample_value(events, {**labels, "event": "backoff"}) == 1
        assert METRICS_REGISTRY.get_sample_value(events, {**labels, "event": "restarted"}) == 1
