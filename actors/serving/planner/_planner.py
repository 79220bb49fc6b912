"""The SLA planner: observes each interval's load, predicts the next, sizes the prefill and
decode pools for it by the profile, and damps the scale-downs."""

from __future__ import annotations

from collections import deque

import attrs
import msgspec

from actors.serving.planner._decide import Damper, Decision, Hysteresis
from actors.serving.planner._predict import Constant, Load, Predictor, forecast
from actors.serving.planner._profile import PerformanceProfile
from actors.serving.planner._sizing import Bounds, Need, Targets, decode_need, prefill_need

__all__ = ["Plan", "Planner", "PlannerConfig"]


@attrs.frozen
class PlannerConfig:
    """The SLA planner's settings; ``history``: the intervals the predictor looks back over."""

    targets: Targets
    prefill: Bounds = attrs.field(factory=Bounds)
    decode: Bounds = attrs.field(factory=Bounds)
    predictor: Predictor = attrs.field(factory=Constant)
    hysteresis: Hysteresis = attrs.field(factory=Hysteresis)
    history: int = attrs.field(default=256, validator=attrs.validators.ge(1))


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    """One interval's plan: the load it was made for, and each pool's decision."""

    load: Load
    prefill: Decision
    decode: Decision


class Planner:
    """One model's SLA planner (disaggregated: a prefill and a decode pool)."""

    def __init__(self, config: PlannerConfig, profile: PerformanceProfile) -> None:
        self.config = config
        self.profile = profile
        self._history: deque[Load] = deque(maxlen=config.history)
        self._prefill = Damper(config.hysteresis)
        self._decode = Damper(config.hysteresis)

    def observe(self, load: Load) -> None:
        """Record the load of the interval that just ended."""
        self._history.append(load)

    def plan(self, prefill_workers: int, decode_workers: int) -> Plan | None:
        """The decisions for the next interval, given the workers each pool has now; None until
        a load has been observed."""
        if not self._history:
            return None
        config = self.config
        load = forecast(self._history, config.predictor)
        return Plan(
            load=load,
            prefill=self._decide(
                self._prefill,
                prefill_workers,
                prefill_need(load, self.profile, config.targets, config.prefill),
            ),
            decode=self._decide(
                self._decode,
                decode_workers,
                decode_need(load, self.profile, config.targets, config.decode),
            ),
        )

    @staticmethod
    def _decide(damper: Damper, current: int, need: Need) -> Decision:
        target, action = damper.step(current, need.workers)
        return Decision(
            role=need.role,
            current=current,
            wanted=need.workers,
            target=target,
            action=action,
            basis=need.basis,
            target_met=need.target_met,
        )
