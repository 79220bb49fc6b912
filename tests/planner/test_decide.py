"""Decisions: scale-down hysteresis, the load-based watermark mode, and the SLA planner over
observed intervals, each decision a record with its reason."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from actors.serving.planner import (
    Bounds,
    Constant,
    Damper,
    Holt,
    Hysteresis,
    Load,
    Planner,
    PlannerConfig,
    PoolLoad,
    Targets,
    Watermarks,
    WatermarkScaler,
    prefill_need,
)
from tests.planner._profiles import PROFILE


def test_up_at_once_down_after_a_streak_to_the_most_it_asked_for() -> None:
    damper = Damper(Hysteresis(down_after=3, drop_fraction=0.25))
    assert damper.step(4, 6) == (6, "up")
    assert damper.step(6, 6) == (6, "hold")
    assert damper.step(6, 4) == (6, "pending")
    assert damper.step(6, 5) == (6, "pending")
    assert damper.step(6, 3) == (5, "down")
    # An interval that asks for as many starts the streak again.
    assert [damper.step(5, w) for w in (4, 5, 4, 4)] == [
        (5, "pending"),
        (5, "hold"),
        (5, "pending"),
        (5, "pending"),
    ]
    assert damper.step(5, 4) == (4, "down")


def test_a_load_that_collapses_is_dropped_to_at_once() -> None:
    damper = Damper(Hysteresis(down_after=5, drop_fraction=0.5))
    assert damper.step(8, 5) == (8, "pending")
    assert damper.step(8, 4) == (4, "drop")


def test_an_ask_that_flaps_does_not_flap_the_pool() -> None:
    damper = Damper(Hysteresis(down_after=3))
    targets = [damper.step(4, wanted)[0] for wanted in [3, 4] * 10]
    assert set(targets) == {4}


def test_watermarks_scale_by_one_after_sustained_intervals() -> None:
    scaler = WatermarkScaler("decode", Watermarks(sustain=2), Bounds(minimum=1, budget=3))
    busy = PoolLoad(workers=2, queued=10.0, kv_usage=0.5)  # 5 waiting a worker
    first, second = scaler.decide(busy), scaler.decide(busy)
    assert (first.action, first.target, first.basis) == ("pending", 2, "above_high")
    assert (second.action, second.target, second.basis) == ("up", 3, "above_high")
    full = PoolLoad(workers=3, queued=0.0, kv_usage=0.9)
    at_budget = [scaler.decide(full) for _ in range(3)]
    assert {(d.action, d.wanted, d.basis) for d in at_budget} == {("hold", 3, "budget")}
    idle = PoolLoad(workers=3, queued=0.0, kv_usage=0.1)
    middling = PoolLoad(workers=3, queued=1.0, kv_usage=0.5)
    decisions = [scaler.decide(load) for load in (idle, middling, idle, idle)]
    assert [d.action for d in decisions] == ["pending", "hold", "pending", "down"]
    assert decisions[1].basis == "between" and decisions[-1].target == 2
    assert decisions[-1].basis == "below_low"


def test_watermarks_hold_a_pool_within_its_bounds() -> None:
    scaler = WatermarkScaler("prefill", Watermarks(sustain=1), Bounds(minimum=1, budget=4))
    empty = scaler.decide(PoolLoad(workers=0, queued=0.0, kv_usage=0.0))
    assert (empty.action, empty.target, empty.basis) == ("up", 1, "minimum")
    waiting = scaler.decide(PoolLoad(workers=0, queued=5.0, kv_usage=0.0))
    assert (waiting.action, waiting.target) == ("up", 1)
    with pytest.raises(ValueError, match="below its high"):
        Watermarks(kv_low=0.9, kv_high=0.8)


def _planner(predictor: Constant | Holt, hysteresis: Hysteresis | None = None) -> Planner:
    config = PlannerConfig(
        targets=Targets(ttft_ms=300.0, itl_ms=20.0),
        prefill=Bounds(minimum=1, budget=32),
        decode=Bounds(minimum=1, budget=32),
        predictor=predictor,
        hysteresis=hysteresis or Hysteresis(),
    )
    return Planner(config, PROFILE)


def test_the_planner_plans_once_it_has_seen_a_load() -> None:
    planner = _planner(Constant())
    assert planner.plan(1, 1) is None
    planner.observe(Load(rate=25.0, isl=1000.0, osl=400.0))
    plan = planner.plan(1, 1)
    assert plan is not None and plan.load == Load(rate=25.0, isl=1000.0, osl=400.0)
    assert (plan.prefill.role, plan.prefill.action, plan.prefill.target) == ("prefill", "up", 4)
    assert (plan.decode.role, plan.decode.action) == ("decode", "up")
    # A record for logs and metrics: it encodes as it is.
    assert msgspec.json.decode(msgspec.json.encode(plan))["prefill"]["basis"] == "load"


def test_a_trend_predictor_falls_short_of_a_rising_load_less_often() -> None:
    targets, bounds = Targets(ttft_ms=300.0, itl_ms=20.0), Bounds(minimum=1, budget=32)
    ramp = [Load(rate=1.5 * t, isl=1000.0, osl=400.0) for t in range(1, 40)]
    short = {}
    for name, rule in (("constant", Constant()), ("holt", Holt())):
        planner, short[name] = _planner(rule), 0
        for now, then in itertools.pairwise(ramp):
            planner.observe(now)
            plan = planner.plan(1, 1)
            assert plan is not None
            short[name] += (
                plan.prefill.wanted < prefill_need(then, PROFILE, targets, bounds).workers
            )
    assert short["holt"] < short["constant"]


def test_the_planner_scales_down_only_after_the_load_stays_down() -> None:
    planner = _planner(Constant(), Hysteresis(down_after=3, drop_fraction=0.1))
    planner.observe(Load(rate=25.0, isl=1000.0, osl=400.0))
    plan = planner.plan(1, 1)
    assert plan is not None
    prefill = plan.prefill.target
    planner.observe(Load(rate=15.0, isl=1000.0, osl=400.0))
    actions = []
    for _ in range(3):
        plan = planner.plan(prefill, plan.decode.target)
        assert plan is not None
        actions.append(plan.prefill.action)
    assert actions == ["pending", "pending", "down"]
    assert plan.prefill.target < prefill
