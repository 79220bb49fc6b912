"""Scenarios from TOML or YAML files.

::

    name = "kill-one-of-two"
    description = "SIGKILL a worker mid-stream; every stream completes unchanged"

    [topology]               # ServeConfig fields over the scenario defaults
    decode_workers = 2
    router = "round_robin"

    [workload]               # Workload fields
    clients = 4
    max_tokens = 96

    [[faults]]               # one table per fault: kind plus that fault's fields
    kind = "kill"
    worker = "busiest"
    when_busy = 2

    [expect]                 # Expect fields
    max_token_gap_s = 5
    [expect.counters]
    migrations = { min = 1 }
    escalations = 0
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import attrs

import scenarios._lifecycle  # noqa: F401  (registers the lifecycle fault kinds)
from actors.serving import load_config
from scenarios._faults_model import fault_from_dict
from scenarios._model import _FAST_SERVE, FAST_ENGINE, Expect, Scenario, Workload

__all__ = ["load_scenario", "scenario_from_dict"]


def load_scenario(path: str | Path) -> Scenario:
    """The scenario a ``.toml`` or ``.yaml``/``.yml`` file declares (``ValueError`` if it is
    not a valid one)."""
    text = Path(path).read_text()
    if str(path).endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        data = tomllib.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a table at the top level")
    data.setdefault("name", Path(path).stem)
    return scenario_from_dict(data)


def _fields(cls: type[Any], data: Any, what: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ValueError(f"[{what}] must be a table")
    known = {a.name for a in attrs.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"[{what}]: unknown field(s) {', '.join(unknown)}")
    return data


def scenario_from_dict(data: dict[str, Any]) -> Scenario:
    """The scenario a parsed TOML/YAML document declares."""
    data = dict(data)
    topology = dict(data.pop("topology", {}) or {})
    engine_args = {**FAST_ENGINE, **topology.pop("engine_args", {})}
    # load_config validates (types, literals, unknown keys) the way ``actorserve run`` does.
    config = load_config(None, {**_FAST_SERVE, **topology, "engine_args": engine_args})
    workload = Workload(**_fields(Workload, data.pop("workload", {}) or {}, "workload"))
    expect = Expect(**_fields(Expect, data.pop("expect", {}) or {}, "expect"))
    faults = tuple(fault_from_dict(f) for f in data.pop("faults", []) or [])
    known = {"name", "description", "baseline", "settle_s", "process"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown scenario field(s) {', '.join(unknown)}")
    if "name" not in data:
        raise ValueError("a scenario needs a name")
    return Scenario(topology=config, workload=workload, faults=faults, expect=expect, **data)
