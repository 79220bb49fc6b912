"""OTP's sup_start_map / child_specs / child_specs_map / sup_flags groups: defaults, precise
errors for malformed specs and flags, unknown keys tolerated."""

from __future__ import annotations

import math
from typing import Any

import pytest

from actors import WhileRestarting
from supervisors import (
    AutoShutdown,
    Backoff,
    ChildSpec,
    InvalidChildSpec,
    InvalidFlags,
    Restart,
    Strategy,
    Supervisor,
    SupervisorError,
    SupervisorFlags,
    open_supervisor,
)
from tests.helpers.supervision import Worker, worker_spec


def test_child_spec_defaults() -> None:
    spec = ChildSpec("a", Worker)
    assert spec.restart is Restart.PERMANENT
    assert spec.kind == "worker"
    assert spec.shutdown is None and spec.shutdown_timeout == 5.0  # OTP: 5000 ms for workers
    assert not spec.significant
    assert spec.name is None and spec.backoff is None and spec.start_timeout is None
    assert spec.while_restarting == WhileRestarting("fail")
    assert ChildSpec("s", Supervisor, kind="supervisor").shutdown_timeout == math.inf
    assert ChildSpec("a", Worker, shutdown="brutal_kill").shutdown_timeout == 0.0
    assert ChildSpec("a", Worker, shutdown="infinity").shutdown_timeout == math.inf
    assert ChildSpec("a", Worker, shutdown=2).shutdown_timeout == 2.0


def test_child_spec_from_mapping_fills_defaults_and_ignores_unknown_keys() -> None:
    spec = ChildSpec.from_mapping({"id": "a", "start": Worker, "modules": ["w"], "extra": 1})
    assert spec == ChildSpec("a", Worker)
    full = ChildSpec.from_mapping(
        {
            "id": "b",
            "start": Worker,
            "restart": "transient",
            "shutdown": "brutal_kill",
            "kind": "supervisor",
            "significant": True,
            "name": "svc",
            "backoff": {"min_delay": 1, "max_delay": 8},
            "while_restarting": {"mode": "wait", "timeout": 2},
            "start_timeout": 3,
        }
    )
    assert full.restart is Restart.TRANSIENT
    assert full.shutdown == "brutal_kill" and full.kind == "supervisor" and full.significant
    assert full.backoff == Backoff(min_delay=1.0, max_delay=8.0)
    assert full.while_restarting == WhileRestarting("wait", 2.0)
    assert full.start_timeout == 3.0 and full.name == "svc"
    assert ChildSpec.from_mapping({"id": "c", "start": Worker, "shutdown": 0.5}).shutdown == 0.5


@pytest.mark.parametrize(
    ("mapping", "field"),
    [
        ({"start": Worker}, "id"),
        ({"id": "a"}, "start"),
        ({}, "id"),
        ({"id": "", "start": Worker}, "id"),
        ({"id": 5, "start": Worker}, "id"),
        ({"id": "a", "start": 3}, "start"),
        ({"id": "a", "start": Worker, "restart": "sometimes"}, "restart"),
        ({"id": "a", "start": Worker, "shutdown": -1}, "shutdown"),
        ({"id": "a", "start": Worker, "shutdown": "never"}, "shutdown"),
        ({"id": "a", "start": Worker, "shutdown": True}, "shutdown"),
        ({"id": "a", "start": Worker, "kind": "manager"}, "kind"),
        ({"id": "a", "start": Worker, "significant": "yes", "restart": "transient"}, "significant"),
        ({"id": "a", "start": Worker, "significant": True}, "significant"),
        ({"id": "a", "start": Worker, "name": 3}, "name"),
        ({"id": "a", "start": Worker, "start_timeout": 0}, "start_timeout"),
        ({"id": "a", "start": Worker, "start_timeout": "soon"}, "start_timeout"),
        ({"id": "a", "start": Worker, "backoff": {"min_delay": 5, "max_delay": 1}}, "backoff"),
        ({"id": "a", "start": Worker, "backoff": {"min_delay": "x"}}, "backoff.min_delay"),
        ({"id": "a", "start": Worker, "while_restarting": {"mode": "x"}}, "while_restarting.mode"),
    ],
)
def test_child_spec_from_mapping_precise_errors(mapping: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidChildSpec) as info:
        ChildSpec.from_mapping(mapping)
    assert info.value.field == field
    assert info.value.child_id == mapping.get("id")
    assert field.split(".")[0] in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"restart": "permanent"}, "restart"),
        ({"shutdown": -0.1}, "shutdown"),
        ({"kind": "boss"}, "kind"),
        ({"restart": Restart.PERMANENT, "significant": True}, "significant"),
        ({"start_timeout": -1}, "start_timeout"),
        ({"backoff": 3}, "backoff"),
        ({"while_restarting": "wait"}, "while_restarting"),
    ],
)
def test_child_spec_rejects_invalid_values(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidChildSpec) as info:
        ChildSpec("a", Worker, **kwargs)
    assert info.value.field == field


def test_significant_needs_transient_or_temporary() -> None:
    for restart in (Restart.TRANSIENT, Restart.TEMPORARY):
        assert ChildSpec("a", Worker, restart=restart, significant=True).significant
    with pytest.raises(InvalidChildSpec, match="permanent child cannot be significant"):
        ChildSpec("a", Worker, significant=True)


def test_flags_defaults() -> None:
    flags = SupervisorFlags()
    assert flags.strategy is Strategy.ONE_FOR_ONE
    assert (flags.intensity, flags.period) == (1, 5.0)  # OTP's defaults
    assert flags.auto_shutdown is AutoShutdown.NEVER
    assert SupervisorFlags.from_mapping({}) == flags
    assert SupervisorFlags.from_mapping({"unknown": 1, "intensity": 3}).intensity == 3


def test_flags_from_mapping() -> None:
    flags = SupervisorFlags.from_mapping(
        {
            "strategy": "rest_for_one",
            "intensity": 10,
            "period": 60,
            "auto_shutdown": "all_significant",
        }
    )
    assert flags == SupervisorFlags(Strategy.REST_FOR_ONE, 10, 60.0, AutoShutdown.ALL_SIGNIFICANT)


@pytest.mark.parametrize(
    ("mapping", "field"),
    [
        ({"strategy": "one_for_some"}, "strategy"),
        ({"intensity": -1}, "intensity"),
        ({"intensity": 1.5}, "intensity"),
        ({"intensity": True}, "intensity"),
        ({"intensity": "3"}, "intensity"),
        ({"period": 0}, "period"),
        ({"period": -5}, "period"),
        ({"period": "5"}, "period"),
        ({"auto_shutdown": "sometimes"}, "auto_shutdown"),
    ],
)
def test_flags_precise_errors(mapping: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidFlags) as info:
        SupervisorFlags.from_mapping(mapping)
    assert info.value.field == field
    assert field in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"strategy": "one_for_one"}, "strategy"),
        ({"intensity": 2.0}, "intensity"),
        ({"period": 0}, "period"),
        ({"auto_shutdown": "never"}, "auto_shutdown"),
    ],
)
def test_flags_reject_invalid_values(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidFlags) as info:
        SupervisorFlags(**kwargs)
    assert info.value.field == field


def test_duplicate_ids_are_rejected() -> None:
    with pytest.raises(InvalidChildSpec, match="duplicate child id") as info:
        Supervisor([worker_spec("a"), worker_spec("b"), worker_spec("a")])
    assert info.value.child_id == "a"


def test_not_a_child_spec_is_rejected() -> None:
    with pytest.raises(InvalidChildSpec, match="not a ChildSpec"):
        Supervisor([{"id": "a", "start": Worker}])  # type: ignore[list-item]


def test_simple_one_for_one_needs_exactly_one_template() -> None:
    flags = SupervisorFlags(Strategy.SIMPLE_ONE_FOR_ONE)
    for specs in ([], [worker_spec("a"), worker_spec("b")]):
        with pytest.raises(InvalidChildSpec, match="exactly one template"):
            Supervisor(specs, flags)


def test_spec_errors_are_supervisor_errors() -> None:
    # Returned to the caller of start_child as OTP's {error, Reason}, never crashing the tree.
    assert issubclass(InvalidChildSpec, SupervisorError)
    assert issubclass(InvalidFlags, SupervisorError)


async def test_open_supervisor_rejects_duplicate_ids() -> None:
    with pytest.raises(InvalidChildSpec, match="duplicate"):
        async with open_supervisor([worker_spec("a"), worker_spec("a")]):
            pytest.fail("must not start")


def test_backoff_validation_and_delays() -> None:
    for kwargs in (
        {"min_delay": -1},
        {"min_delay": 2, "max_delay": 1},
        {"multiplier": 0.5},
        {"jitter": 1.0},
        {"jitter": -0.1},
        {"reset_after": -1},
    ):
        with pytest.raises(ValueError, match="backoff needs"):
            Backoff(**kwargs)
    backoff = Backoff(min_delay=0.5, max_delay=8.0, multiplier=2.0, jitter=0.0)
    assert [backoff.delay(n, 0.5) for n in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    jittered = Backoff(min_delay=1.0, max_delay=1.0, jitter=0.25)
    assert jittered.delay(0, 0.0) == 0.75
    assert jittered.delay(0, 0.5) == 1.0
    assert jittered.delay(0, 0.999999) == pytest.approx(1.25, abs=1e-5)
