"""Declaring scenarios: files, validation, bounds (no serving tree here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scenarios import (
    FAULT_KINDS,
    Bound,
    CancelRequest,
    Expect,
    KillEngine,
    Scenario,
    load_scenario,
    scenario_from_dict,
)


def test_bounds() -> None:
    assert Bound(min=1).holds(1) and not Bound(min=1).holds(0)
    assert Bound(max=0).holds(0) and not Bound(max=0).holds(1)
    assert str(Bound(2, 2)) == "2" and str(Bound(min=1)) == ">= 1"
    expect = Expect(counters={"migrations": 0, "restarts": {"min": 1}})  # type: ignore[dict-item]
    assert expect.counters == {"migrations": Bound(0, 0), "restarts": Bound(min=1)}


def test_yaml_and_toml_declare_the_same_scenario(tmp_path: Path) -> None:
    toml = tmp_path / "kill.toml"
    toml.write_text(
        'name = "kill"\n[topology]\ndecode_workers = 3\n[workload]\nclients = 2\n'
        '[[faults]]\nkind = "kill"\nwhen_busy = 1\n[expect]\nsuccess_rate = 0.5\n'
    )
    yaml = tmp_path / "kill.yaml"
    yaml.write_text(
        "name: kill\ntopology: {decode_workers: 3}\nworkload: {clients: 2}\n"
        "faults: [{kind: kill, when_busy: 1}]\nexpect: {success_rate: 0.5}\n"
    )
    a, b = load_scenario(toml), load_scenario(yaml)
    assert a == b
    assert a.topology.decode_workers == 3 and a.topology.port == 0  # scenario defaults kept
    assert a.topology.engine_args["timing"] == {"speedup": 20.0}
    assert a.faults == (KillEngine(when_busy=1),)


@pytest.mark.parametrize(
    ("data", "error"),
    [
        ({"name": "x", "faults": [{"kind": "explode"}]}, "unknown fault kind 'explode'"),
        ({"name": "x", "faults": [{"kind": "kill", "signal": 9, "oops": 1}]}, "fault 'kill'"),
        ({"name": "x", "workload": {"clinets": 2}}, "unknown field(s) clinets"),
        ({"name": "x", "topology": {"router": "random"}}, "router"),
        ({"name": "x", "colour": "red"}, "unknown scenario field(s) colour"),
        ({"description": "nameless"}, "needs a name"),
    ],
)
def test_bad_declarations_say_what_is_wrong(data: dict[str, object], error: str) -> None:
    with pytest.raises(ValueError, match=None) as raised:
        scenario_from_dict(data)
    assert error in str(raised.value)


def test_a_root_in_its_own_process_takes_only_root_faults() -> None:
    Scenario(name="ok", process="subprocess", faults=[CancelRequest()])
    with pytest.raises(ValueError, match="need the root in this process"):
        Scenario(name="bad", process="subprocess", faults=[KillEngine()])


def test_every_fault_kind_is_loadable_by_name() -> None:
    for kind, cls in FAULT_KINDS.items():
        assert scenario_from_dict({"name": kind, "faults": [{"kind": kind}]}).faults == (cls(),)
