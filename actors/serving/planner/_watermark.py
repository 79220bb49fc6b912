"""The load-based mode, which needs no profile: a pool grows by one worker while its queue or
KV usage per worker stays above a high watermark, and shrinks by one while both stay below low
watermarks."""

from __future__ import annotations

import attrs
import msgspec

from actors.serving.planner._decide import Action, Decision
from actors.serving.planner._sizing import Bounds, Role

__all__ = ["PoolLoad", "WatermarkScaler", "Watermarks"]


class PoolLoad(msgspec.Struct, frozen=True, kw_only=True):
    """A pool's load over one interval: its workers, the requests waiting across them, and their
    mean KV cache usage (a fraction)."""

    workers: int
    queued: float
    kv_usage: float


@attrs.frozen
class Watermarks:
    """Per worker: waiting requests and KV usage; a change needs ``sustain`` intervals in a
    row on the same side."""

    queue_high: float = 4.0
    queue_low: float = 0.5
    kv_high: float = 0.85
    kv_low: float = 0.3
    sustain: int = attrs.field(default=3, validator=attrs.validators.ge(1))

    def __attrs_post_init__(self) -> None:
        if not (0 <= self.queue_low < self.queue_high and 0 <= self.kv_low < self.kv_high):
            raise ValueError(f"each low watermark must lie below its high one: {self}")


class WatermarkScaler:
    """One pool's load-based scaling: counts the intervals in a row above or below."""

    def __init__(self, role: Role, marks: Watermarks, bounds: Bounds) -> None:
        self.role = role
        self.marks = marks
        self.bounds = bounds
        self._side: int = 0  # +1 above the high watermarks, -1 below the low ones
        self._run = 0

    def decide(self, load: PoolLoad) -> Decision:
        """This interval's decision for the pool."""
        marks = self.marks
        queued = load.queued / load.workers if load.workers else load.queued
        above = queued > marks.queue_high or load.kv_usage > marks.kv_high
        below = queued < marks.queue_low and load.kv_usage < marks.kv_low
        side = 1 if above else -1 if below else 0
        self._run = self._run + 1 if side == self._side else 1
        self._side = side
        wanted, basis = self.bounds.clamp(load.workers + side)
        if basis == "load":
            basis = "above_high" if above else "below_low" if below else "between"
        target = load.workers
        action: Action = "hold"
        if wanted != load.workers:
            # A pool outside its bounds goes within them at once, else only a sustained load.
            outside = not self.bounds.minimum <= load.workers <= self.bounds.budget
            if outside or self._run >= marks.sustain:
                target, self._run = wanted, 0
                action = "up" if wanted > load.workers else "down"
            else:
                action = "pending"
        return Decision(
            role=self.role,
            current=load.workers,
            wanted=wanted,
            target=target,
            action=action,
            basis=basis,
        )
