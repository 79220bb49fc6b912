"""OTP's child_adm / child_adm_simple groups: every administration call's success and every error
return; the supervisor goes on after each error (they are replies, not failures)."""

from __future__ import annotations

import pytest

from actors import ActorNotRunning, VirtualClock
from actors.testing import wait_until
from supervisors import (
    Backoff,
    ChildAlreadyPresent,
    ChildAlreadyStarted,
    ChildCount,
    ChildInfo,
    ChildNotFound,
    ChildRestarting,
    ChildRunning,
    ChildSpec,
    Restart,
    Strategy,
    Supervisor,
    SupervisorError,
    SupervisorFlags,
    open_supervisor,
)
from tests.helpers.supervision import Journal, crash, states, worker_spec

FLAGS = SupervisorFlags(intensity=100)
SIMPLE = SupervisorFlags(Strategy.SIMPLE_ONE_FOR_ONE, intensity=100)


async def test_child_adm() -> None:
    journal = Journal()
    async with open_supervisor([worker_spec("a", journal)], FLAGS) as sup:
        spec = worker_spec("b", journal)
        ref = await sup.start_child(spec)
        assert ref is not None and await ref.ask("ping") == "pong"
        assert await sup.which_children() == [
            ChildInfo("a", await sup.child("a"), "running", "worker"),
            ChildInfo("b", ref, "running", "worker"),
        ]
        # already started / already present
        with pytest.raises(ChildAlreadyStarted) as started:
            await sup.start_child(spec)
        assert started.value.child_id == "b" and started.value.ref == ref
        await sup.terminate_child("b")
        assert not ref.is_running and journal.of("stop") == ["b"]
        assert await states(sup) == {"a": "running", "b": "undefined"}
        await sup.terminate_child("b")  # terminating a terminated child is fine
        with pytest.raises(ChildAlreadyPresent):
            await sup.start_child(spec)
        # restart_child: the same ref runs again
        assert await sup.restart_child("b") == ref
        assert await ref.ask("ping") == "pong"
        with pytest.raises(ChildRunning):
            await sup.restart_child("b")
        # delete_child: only when not running
        with pytest.raises(ChildRunning):
            await sup.delete_child("b")
        await sup.terminate_child(ref)  # by ref
        await sup.delete_child("b")
        assert await states(sup) == {"a": "running"}
        with pytest.raises(ChildNotFound):
            await sup.delete_child("b")
        # after delete_child the id is free again
        assert await sup.start_child(spec) is not None
        assert sup.ref.statistics().incarnation == 1  # no error crashed the supervisor


async def test_unknown_child_errors() -> None:
    async with open_supervisor([worker_spec("a")]) as sup:
        for call in (sup.terminate_child, sup.restart_child, sup.delete_child, sup.get_childspec):
            with pytest.raises(ChildNotFound) as info:
                await call("nope")
            assert info.value.child_id == "nope"
        other = [worker_spec("x")]
        async with open_supervisor(other, name="other") as other_sup:
            stranger = await other_sup.child("x")
            with pytest.raises(ChildNotFound):
                await sup.terminate_child(stranger)
            with pytest.raises(ChildNotFound):
                await sup.get_childspec(stranger)
        with pytest.raises(KeyError):
            await sup.child("nope")


async def test_get_childspec() -> None:
    spec = worker_spec("a", restart=Restart.TRANSIENT, shutdown=2)
    async with open_supervisor([spec]) as sup:
        assert await sup.get_childspec("a") == spec
        assert await sup.get_childspec(await sup.child("a")) == spec


async def test_restarting_child_errors() -> None:
    clock = VirtualClock()
    spec = worker_spec("a", backoff=Backoff(min_delay=5, max_delay=5, jitter=0))
    async with open_supervisor([spec], FLAGS, clock=clock) as sup:
        ref = await sup.child("a")
        await crash(ref, sup)
        assert await states(sup) == {"a": "restarting"}
        with pytest.raises(ChildRestarting):
            await sup.restart_child("a")
        with pytest.raises(ChildRestarting):
            await sup.delete_child("a")
        with pytest.raises(ChildAlreadyPresent):
            await sup.start_child(spec)
        # terminate_child cancels the pending restart (OTP: the child becomes undefined).
        await sup.terminate_child("a")
        assert await states(sup) == {"a": "undefined"}
        await wait_until(lambda: clock.sleepers == 1)
        clock.advance(5)
        await sup.count_children()
        assert await states(sup) == {"a": "undefined"}
        assert await sup.restart_child("a") == ref


async def test_terminate_temporary_child_forgets_it() -> None:
    async with open_supervisor([worker_spec("t", restart=Restart.TEMPORARY)]) as sup:
        ref = await sup.child("t")
        await sup.terminate_child("t")
        assert await sup.which_children() == []
        assert not ref.is_running
        with pytest.raises(ChildNotFound):
            await sup.restart_child("t")


async def test_count_children() -> None:
    def inner() -> Supervisor:
        return Supervisor([worker_spec("x")], name="inner")

    specs = [
        worker_spec("a"),
        worker_spec("b"),
        ChildSpec("s", inner, kind="supervisor"),
    ]
    async with open_supervisor(specs) as sup:
        assert await sup.count_children() == ChildCount(specs=3, active=3, supervisors=1, workers=2)
        await sup.terminate_child("b")
        await sup.terminate_child("s")
        # OTP: supervisors/workers count specs, whether or not their process is alive.
        assert await sup.count_children() == ChildCount(specs=3, active=1, supervisors=1, workers=2)
        stats = await sup.statistics()
        assert (stats.children, stats.active, stats.strategy) == (3, 1, "one_for_one")


async def test_calls_on_a_stopped_supervisor_fail_fast() -> None:
    async with open_supervisor([worker_spec("a")]) as sup:
        pass
    with pytest.raises(ActorNotRunning):
        await sup.which_children()
    with pytest.raises(ActorNotRunning):
        await sup.start_child(worker_spec("b"))


# -- simple_one_for_one ----------------------------------------------------------------------


async def test_child_adm_simple() -> None:
    template = worker_spec("t")
    async with open_supervisor([template], SIMPLE) as sup:
        assert await sup.which_children() == []
        assert await sup.count_children() == ChildCount(specs=1, active=0, supervisors=0, workers=0)
        refs = [await sup.start_dynamic() for _ in range(3)]
        assert all(r is not None for r in refs)
        assert len(set(refs)) == 3
        assert [c.ref for c in await sup.which_children()] == refs
        assert await sup.count_children() == ChildCount(specs=1, active=3, supervisors=0, workers=3)
        assert await sup.get_childspec(refs[0]) == template
        # terminate_child by ref: the child is gone (dynamic children are not kept)
        await sup.terminate_child(refs[1])
        assert not refs[1].is_running
        assert [c.ref for c in await sup.which_children()] == [refs[0], refs[2]]
        with pytest.raises(ChildNotFound):
            await sup.terminate_child(refs[1])
        # restrictions
        with pytest.raises(SupervisorError, match="simple_one_for_one"):
            await sup.restart_child((await sup.which_children())[0].id)
        with pytest.raises(SupervisorError, match="simple_one_for_one"):
            await sup.delete_child((await sup.which_children())[0].id)
        with pytest.raises(SupervisorError, match="simple_one_for_one"):
            await sup.start_child(worker_spec("other"))
        assert await sup.count_children() == ChildCount(specs=1, active=2, supervisors=0, workers=2)


async def test_start_dynamic_on_a_static_supervisor_is_an_error() -> None:
    async with open_supervisor([worker_spec("a")]) as sup:
        with pytest.raises(SupervisorError, match="needs a child spec"):
            await sup.start_dynamic()
