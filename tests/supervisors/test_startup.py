"""OTP's sup_start group: normal start, ``ignore`` (permanent vs temporary, static vs start_child
vs simple_one_for_one), start failures and start timeouts."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from actors import Actor, ExitReason
from supervisors import (
    ChildCount,
    ChildSpec,
    ChildStartFailed,
    Restart,
    Strategy,
    Supervisor,
    SupervisorFlags,
    SupervisorRef,
    open_supervisor,
)
from tests.helpers.supervision import Boom, Journal, StartControl, Worker, states, worker_spec

SIMPLE = SupervisorFlags(Strategy.SIMPLE_ONE_FOR_ONE, intensity=10)


async def test_normal_start_in_declared_order() -> None:
    journal = Journal()
    specs = [worker_spec(tag, journal) for tag in ("a", "b", "c")]
    async with open_supervisor(specs) as sup:
        # Start-up is synchronous: every child is ready before the body runs.
        assert journal.of("start") == ["a", "b", "c"]
        assert await states(sup) == {"a": "running", "b": "running", "c": "running"}
        assert [c.id for c in await sup.which_children()] == ["a", "b", "c"]
        assert await sup.count_children() == ChildCount(specs=3, active=3, supervisors=0, workers=3)
    assert journal.of("stop") == ["c", "b", "a"]


async def test_empty_supervisor() -> None:
    async with open_supervisor() as sup:
        assert await sup.which_children() == []
        assert await sup.count_children() == ChildCount(0, 0, 0, 0)


async def test_static_permanent_child_returning_ignore_is_kept() -> None:
    ignore = StartControl(ignore=1)
    journal = Journal()
    specs = [
        worker_spec("a", journal),
        worker_spec("b", journal, ignore),
        worker_spec("c", journal),
    ]
    async with open_supervisor(specs) as sup:
        assert await states(sup) == {"a": "running", "b": "undefined", "c": "running"}
        assert await sup.count_children() == ChildCount(specs=3, active=2, supervisors=0, workers=3)
        b = await sup.child("b")
        assert not b.is_running
        assert await sup.restart_child("b") == b  # the spec was kept: it can be restarted
        assert await b.ask("ping") == "pong"
    assert journal.of("ignored") == ["b"]


async def test_static_temporary_child_returning_ignore_is_forgotten() -> None:
    specs = [
        worker_spec("a"),
        worker_spec("b", control=StartControl(ignore_always=True), restart=Restart.TEMPORARY),
    ]
    async with open_supervisor(specs) as sup:
        assert await states(sup) == {"a": "running"}
        assert await sup.count_children() == ChildCount(specs=1, active=1, supervisors=0, workers=1)


async def test_start_child_returning_ignore() -> None:
    async with open_supervisor() as sup:
        permanent = worker_spec("p", control=StartControl(ignore_always=True))
        temporary = worker_spec(
            "t", control=StartControl(ignore_always=True), restart=Restart.TEMPORARY
        )
        assert await sup.start_child(permanent) is None
        assert await sup.start_child(temporary) is None
        assert await sup.start_child(worker_spec("ok", restart=Restart.TEMPORARY)) is not None
        # OTP: the permanent child's spec is kept, the temporary one's is not.
        assert await states(sup) == {"p": "undefined", "ok": "running"}
        assert await sup.count_children() == ChildCount(specs=2, active=1, supervisors=0, workers=2)


async def test_simple_one_for_one_child_returning_ignore() -> None:
    control = StartControl(ignore=1)
    spec = ChildSpec("t", lambda tag: Worker(tag, None, control))
    async with open_supervisor([spec], SIMPLE) as sup:
        assert await sup.start_dynamic("x") is None
        ref = await sup.start_dynamic("y")
        assert ref is not None and await ref.ask("ping") == "pong"
        assert len(await sup.which_children()) == 1
        assert (await sup.count_children()).active == 1


async def test_start_failure_stops_the_started_children_in_reverse_order() -> None:
    journal = Journal()
    specs = [
        worker_spec("a", journal),
        worker_spec("b", journal),
        worker_spec("c", journal, StartControl(fail_always=True)),
        worker_spec("d", journal),
    ]
    body_ran = False
    with pytest.raises(ChildStartFailed) as info:
        async with open_supervisor(specs):
            body_ran = True
    assert not body_ran
    assert info.value.child_id == "c"
    assert isinstance(info.value.cause, Boom)
    assert journal.events == [
        ("start", "a"),
        ("start", "b"),
        ("start_failed", "c"),
        ("stop", "b"),
        ("stop", "a"),
    ]


async def test_start_failure_of_the_first_child() -> None:
    with pytest.raises(ChildStartFailed) as info:
        async with open_supervisor([worker_spec("a", control=StartControl(fail_always=True))]):
            pytest.fail("must not start")
    assert info.value.child_id == "a"


async def test_start_function_raising_is_a_start_failure() -> None:
    def broken() -> Actor:
        raise Boom("no actor for you")

    with pytest.raises(ChildStartFailed) as info:
        async with open_supervisor([ChildSpec("a", broken)]):
            pytest.fail("must not start")
    assert isinstance(info.value.cause, Boom)


class _CrashesInBackgroundWhileStarting(Actor):
    """started() waits for something a background task of the actor never delivers: it raises."""

    async def started(self) -> None:
        async def fail() -> None:
            raise Boom("background task of a starting actor")

        self.start_soon(fail)
        await anyio.sleep_forever()


async def test_a_task_crashing_while_the_actor_starts_is_a_start_failure() -> None:
    with pytest.raises(ChildStartFailed) as info:
        async with open_supervisor([ChildSpec("a", _CrashesInBackgroundWhileStarting)]):
            pytest.fail("must not start")
    assert isinstance(info.value.cause, Boom)


async def test_start_child_failure_is_returned_and_not_kept() -> None:
    async with open_supervisor([worker_spec("a")]) as sup:
        with pytest.raises(ChildStartFailed) as info:
            await sup.start_child(worker_spec("b", control=StartControl(fail_always=True)))
        assert info.value.child_id == "b" and isinstance(info.value.cause, Boom)
        assert await states(sup) == {"a": "running"}


async def test_restart_child_failure_is_returned_and_the_spec_kept() -> None:
    control = StartControl()
    async with open_supervisor([worker_spec("a", control=control)]) as sup:
        await sup.terminate_child("a")
        control.fail = 1
        with pytest.raises(ChildStartFailed):
            await sup.restart_child("a")
        assert await states(sup) == {"a": "undefined"}
        ref = await sup.restart_child("a")
        assert ref is not None and await ref.ask("ping") == "pong"


async def test_simple_one_for_one_start_failure() -> None:
    spec = ChildSpec("t", lambda: Worker("t", None, StartControl(fail_always=True)))
    async with open_supervisor([spec], SIMPLE) as sup:
        with pytest.raises(ChildStartFailed):
            await sup.start_dynamic()
        assert await sup.which_children() == []


class SlowStart(Actor):
    async def started(self) -> None:
        await anyio.sleep_forever()


async def test_start_timeout() -> None:
    specs = [worker_spec("a"), ChildSpec("slow", SlowStart, start_timeout=0.05)]
    with pytest.raises(ChildStartFailed) as info:
        async with open_supervisor(specs):
            pytest.fail("must not start")
    assert info.value.child_id == "slow"
    assert isinstance(info.value.cause, TimeoutError)


async def test_nested_start_failure_fails_the_parent() -> None:
    journal = Journal()

    def inner() -> Supervisor:
        return Supervisor(
            [worker_spec("x", journal), worker_spec("y", journal, StartControl(fail_always=True))],
            name="inner",
        )

    specs = [worker_spec("a", journal), ChildSpec("inner", inner, kind="supervisor")]
    with pytest.raises(ChildStartFailed) as info:
        async with open_supervisor(specs):
            pytest.fail("must not start")
    assert info.value.child_id == "inner"
    assert isinstance(info.value.cause, ChildStartFailed) and info.value.cause.child_id == "y"
    assert journal.events == [
        ("start", "a"),
        ("start", "x"),
        ("start_failed", "y"),
        ("stop", "x"),
        ("stop", "a"),
    ]


async def test_body_errors_come_out_as_raised() -> None:
    with pytest.raises(KeyError):
        async with open_supervisor([worker_spec("a")]):
            raise KeyError("mine")


async def test_start_dynamic_passes_its_arguments() -> None:
    class Tagged(Actor):
        def __init__(self, tag: str, n: int) -> None:
            self.value = f"{tag}{n}"

        async def receive(self, message: Any) -> Any:
            return self.value

    async with open_supervisor([ChildSpec("t", Tagged)], SIMPLE) as sup:
        refs = [await sup.start_dynamic("x", n) for n in range(3)]
        assert [await r.ask("?") for r in refs if r is not None] == ["x0", "x1", "x2"]
        children = await sup.which_children()
        assert [c.ref for c in children] == refs
        sub = SupervisorRef(sup.ref)
        assert (await sub.count_children()).active == 3


async def test_supervisor_exit_reason_is_shutdown_on_a_normal_stop() -> None:
    async with open_supervisor([worker_spec("a")]) as sup:
        monitor = sup.ref.monitor()
    assert (await monitor.wait()).reason == ExitReason.shutdown()
