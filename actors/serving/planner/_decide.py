"""Decisions: what a pool is scaled to and why, with scale-down hysteresis so that a pool does
not flap with its load."""

from __future__ import annotations

from typing import Literal

import attrs
import msgspec

from actors.serving.planner._sizing import Basis, Role

__all__ = ["Action", "Damper", "Decision", "Hysteresis"]

# up: to what is wanted, at once; down: to the most asked for over the intervals that asked for
# fewer; drop: to what is wanted, at once, the load having fallen below the drop fraction; hold:
# as many as wanted; pending: a change asked for, not (yet) for long enough.
Action = Literal["up", "down", "drop", "hold", "pending"]


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """One interval's decision for one pool: a record for logs and metrics."""

    role: Role
    current: int  # workers the pool has
    wanted: int  # workers the rule asks for this interval (within the bounds)
    target: int  # workers the pool is to have
    action: Action
    basis: Basis  # why ``wanted`` is what it is
    target_met: bool = True  # false: no worker count meets the latency target


@attrs.frozen
class Hysteresis:
    """Scale down only after ``down_after`` intervals in a row asked for fewer workers, or at
    once when one asks for at most ``drop_fraction`` of the workers the pool has."""

    down_after: int = attrs.field(default=3, validator=attrs.validators.ge(1))
    drop_fraction: float = attrs.field(
        default=0.5, validator=[attrs.validators.ge(0.0), attrs.validators.lt(1.0)]
    )


class Damper:
    """One pool's hysteresis: remembers the asks of the intervals that asked for fewer."""

    def __init__(self, rule: Hysteresis) -> None:
        self.rule = rule
        self._fewer: list[int] = []

    def step(self, current: int, wanted: int) -> tuple[int, Action]:
        """The workers to scale to, and the action, given this interval's ask."""
        if wanted >= current:
            self._fewer.clear()
            return wanted, "up" if wanted > current else "hold"
        if wanted <= current * self.rule.drop_fraction:
            self._fewer.clear()
            return wanted, "drop"
        self._fewer.append(wanted)
        if len(self._fewer) < self.rule.down_after:
            return current, "pending"
        # The most asked for over the streak: one interval's dip does not set the size.
        target = max(self._fewer)
        self._fewer.clear()
        return target, "down"
