"""OTP's significant group: auto_shutdown (never / any_significant / all_significant) when
significant children exit by themselves; terminations by the supervisor do not count."""

from __future__ import annotations

import anyio
import pytest

from actors import ExitReason
from supervisors import (
    AutoShutdown,
    ChildSpec,
    Restart,
    Strategy,
    Supervisor,
    SupervisorExited,
    SupervisorFlags,
    SupervisorRef,
    open_supervisor,
)
from tests.helpers.supervision import Journal, crash, exit_with, states, worker_spec

AUTO_SHUTDOWN = ExitReason.shutdown("auto_shutdown")
HOW = ["normal", "shutdown", "error", "killed", "terminated"]


def _flags(mode: AutoShutdown, strategy: Strategy = Strategy.ONE_FOR_ONE) -> SupervisorFlags:
    return SupervisorFlags(strategy, intensity=10, auto_shutdown=mode)


async def _end(sup: SupervisorRef, child_id: str, how: str) -> None:
    """End a child: by itself with a reason, by a crash, or terminated by its supervisor."""
    ref = await sup.child(child_id)
    if how == "terminated":
        await sup.terminate_child(child_id)
    elif how == "error":
        await crash(ref)
    else:
        reasons = {
            "normal": ExitReason.normal(),
            "shutdown": ExitReason.shutdown(),
            "killed": ExitReason.killed("by itself"),
        }
        await exit_with(ref, reasons[how])


def _shuts_down(restart: Restart, how: str) -> bool:
    if how == "terminated":
        return False  # terminations by the supervisor never count
    if restart is Restart.TEMPORARY:
        return True  # never restarted, so any exit of its own counts
    return how in ("normal", "shutdown")  # transient: an abnormal exit is restarted


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("restart", [Restart.TRANSIENT, Restart.TEMPORARY], ids=lambda r: r.value)
async def test_any_significant(restart: Restart, how: str) -> None:
    journal = Journal()
    specs = [
        worker_spec("first", journal),
        worker_spec("sig", journal, restart=restart, significant=True),
        worker_spec("last", journal),
    ]
    expected = _shuts_down(restart, how)
    exited: SupervisorExited | None = None
    try:
        async with open_supervisor(specs, _flags(AutoShutdown.ANY_SIGNIFICANT)) as sup:
            monitor = sup.ref.monitor()
            await _end(sup, "sig", how)
            if expected:
                assert (await monitor.wait()).reason == AUTO_SHUTDOWN
                await anyio.sleep_forever()
            await sup.count_children()
            assert sup.ref.is_running
    except SupervisorExited as exc:
        exited = exc
    assert (exited is not None) == expected
    if exited is not None:
        assert exited.reason == AUTO_SHUTDOWN
        assert journal.of("stop")[-2:] == ["last", "first"]  # the rest, in reverse order


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("restart", [Restart.TRANSIENT, Restart.TEMPORARY], ids=lambda r: r.value)
async def test_all_significant(restart: Restart, how: str) -> None:
    specs = [
        worker_spec("sig1", restart=restart, significant=True),
        worker_spec("other"),
        worker_spec("sig2", restart=restart, significant=True),
    ]
    expected = _shuts_down(restart, how)
    with pytest.raises(SupervisorExited) if expected else _no_error():
        async with open_supervisor(specs, _flags(AutoShutdown.ALL_SIGNIFICANT)) as sup:
            await _end(sup, "sig1", "normal")  # one of two: nothing yet
            await sup.count_children()
            assert sup.ref.is_running
            await _end(sup, "sig2", how)  # the last significant child
            await sup.count_children()
            if expected:
                await anyio.sleep_forever()


async def test_all_significant_counts_children_terminated_by_the_supervisor_as_gone() -> None:
    specs = [
        worker_spec("sig1", restart=Restart.TRANSIENT, significant=True),
        worker_spec("sig2", restart=Restart.TRANSIENT, significant=True),
    ]
    with pytest.raises(SupervisorExited) as info:
        async with open_supervisor(specs, _flags(AutoShutdown.ALL_SIGNIFICANT)) as sup:
            await sup.terminate_child("sig1")  # does not trigger anything by itself...
            await sup.count_children()
            assert sup.ref.is_running
            await _end(sup, "sig2", "normal")  # ...but the last active one exiting does
            await anyio.sleep_forever()
    assert info.value.reason == AUTO_SHUTDOWN


@pytest.mark.parametrize("how", ["normal", "error"])
async def test_never_ignores_significant_children(how: str) -> None:
    specs = [worker_spec("sig", restart=Restart.TEMPORARY, significant=True), worker_spec("b")]
    async with open_supervisor(specs, _flags(AutoShutdown.NEVER)) as sup:
        await _end(sup, "sig", how)
        await sup.count_children()
        assert await states(sup) == {"b": "running"}


async def test_non_significant_children_do_not_count() -> None:
    specs = [
        worker_spec("sig", restart=Restart.TRANSIENT, significant=True),
        worker_spec("t", restart=Restart.TEMPORARY),
    ]
    async with open_supervisor(specs, _flags(AutoShutdown.ANY_SIGNIFICANT)) as sup:
        await _end(sup, "t", "normal")
        await sup.count_children()
        assert await states(sup) == {"sig": "running"}


@pytest.mark.parametrize("strategy", [Strategy.ONE_FOR_ALL, Strategy.REST_FOR_ONE], ids=str)
async def test_significant_bystander_terminated_by_a_group_restart_does_not_count(
    strategy: Strategy,
) -> None:
    specs = [worker_spec("a"), worker_spec("sig", restart=Restart.TEMPORARY, significant=True)]
    async with open_supervisor(specs, _flags(AutoShutdown.ANY_SIGNIFICANT, strategy)) as sup:
        await crash(await sup.child("a"), sup)
        assert await states(sup) == {"a": "running"}  # the temporary bystander is gone, quietly


async def test_a_request_unit_tears_down_when_its_stream_ends() -> None:
    """The per-request work unit: a supervisor whose significant child is the stream; when the
    stream ends, the unit stops its helpers in order, and (being transient and significant in
    turn) takes its parent unit down with it."""
    journal = Journal()

    def unit() -> Supervisor:
        children = [
            worker_spec("helper", journal),
            worker_spec("stream", journal, restart=Restart.TRANSIENT, significant=True),
        ]
        return Supervisor(children, _flags(AutoShutdown.ANY_SIGNIFICANT), name="unit")

    specs = [
        worker_spec("bystander", journal),
        ChildSpec("unit", unit, kind="supervisor", restart=Restart.TRANSIENT, significant=True),
    ]
    with pytest.raises(SupervisorExited) as info:
        async with open_supervisor(specs, _flags(AutoShutdown.ANY_SIGNIFICANT)) as sup:
            unit_ref = SupervisorRef(await sup.child("unit"))
            journal.clear()
            await exit_with(await unit_ref.child("stream"), ExitReason.normal())
            await anyio.sleep_forever()
    assert info.value.reason == AUTO_SHUTDOWN
    assert journal.events == [("stop", "stream"), ("stop", "helper"), ("stop", "bystander")]


class _no_error:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
