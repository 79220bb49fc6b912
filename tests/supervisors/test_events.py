"""Every supervisor state change is a structlog event and a Prometheus metric."""

from __future__ import annotations

import itertools

import anyio
import pytest
from structlog.testing import capture_logs

from actors import ExitReason, VirtualClock
from supervisors import (
    METRICS_REGISTRY,
    AutoShutdown,
    ChildStartFailed,
    Restart,
    SupervisorExited,
    SupervisorFlags,
    open_supervisor,
)
from tests.helpers.supervision import StartControl, crash, exit_with, worker_spec

_names = itertools.count()
pytestmark = pytest.mark.usefixtures("all_logs")


def _count(supervisor: str, child: str, event: str) -> float:
    labels = {"supervisor": supervisor, "child": child, "event": event}
    return METRICS_REGISTRY.get_sample_value("actorserve_supervisor_events_total", labels) or 0.0


async def test_child_events_are_logged_and_counted() -> None:
    name = f"events-{next(_names)}"  # metrics are process-wide: a fresh label set
    control = StartControl(ignore=1)
    flags = SupervisorFlags(intensity=1, auto_shutdown=AutoShutdown.ANY_SIGNIFICANT)
    specs = [
        worker_spec("a"),
        worker_spec("ign", control=control),
        worker_spec("sig", restart=Restart.TRANSIENT, significant=True),
    ]
    with capture_logs() as logs, pytest.raises(SupervisorExited):
        async with open_supervisor(specs, flags, name=name, clock=VirtualClock()) as sup:
            await crash(await sup.child("a"), sup)
            with pytest.raises(ChildStartFailed):
                await sup.start_child(worker_spec("bad", control=StartControl(fail_always=True)))
            await sup.terminate_child("a")
            await exit_with(await sup.child("sig"), ExitReason.normal())
            await anyio.sleep_forever()
    seen = {(e["event"], e.get("child")) for e in logs if e.get("supervisor") == name}
    assert {
        ("started", "a"),
        ("ignored", "ign"),
        ("exited", "a"),
        ("restarted", "a"),
        ("start_failed", "bad"),
        ("terminated", "a"),
        ("exited", "sig"),
        ("auto_shutdown", "sig"),
    } <= seen
    exited = next(e for e in logs if e["event"] == "exited" and e.get("child") == "a")
    assert exited["abnormal"] is True and "Boom" in exited["reason"]
    assert exited["log_level"] == "warning"
    assert _count(name, "a", "started") == 2
    assert _count(name, "a", "restarted") == 1
    assert _count(name, "sig", "auto_shutdown") == 1


async def test_escalation_is_logged_and_counted() -> None:
    name = f"events-{next(_names)}"
    with capture_logs() as logs, pytest.raises(SupervisorExited):
        async with open_supervisor(
            [worker_spec("a")], SupervisorFlags(intensity=0), name=name
        ) as sup:
            await crash(await sup.child("a"))
            await anyio.sleep_forever()
    assert any(e["event"] == "escalated" and e["log_level"] == "warning" for e in logs)
    assert _count(name, "-", "escalated") == 1


async def test_forgotten_children_leave_no_series() -> None:
    name = f"events-{next(_names)}"
    async with open_supervisor([], name=name) as sup:
        for i in range(3):
            ref = await sup.start_child(worker_spec(f"tmp-{i}", restart=Restart.TEMPORARY))
            assert ref is not None
            await exit_with(ref, ExitReason.normal(), sup)
        assert _count(name, "tmp-0", "started") == 0  # dropped with the child
        await sup.start_child(worker_spec("kept"))
        assert _count(name, "kept", "started") == 1
