"""The sizing rule (Dynamo's SLA planner's): how many prefill and decode workers a predicted
load needs to meet the TTFT and ITL targets, by an engine's performance profile."""

from __future__ import annotations

import math
from typing import Literal

import attrs
import msgspec

from actors.serving.planner._predict import Load
from actors.serving.planner._profile import PerformanceProfile

__all__ = ["Basis", "Bounds", "Need", "Role", "Targets", "decode_need", "prefill_need"]

Role = Literal["prefill", "decode"]
# Why a pool wants the workers it does: the load, or the bounds it was clamped to; the watermark
# mode's are where the load stood against its watermarks.
Basis = Literal["load", "minimum", "budget", "above_high", "below_low", "between"]

# A computed 3.0000000001 workers is 3, not 4.
_SLACK = 1e-9


@attrs.frozen
class Targets:
    """The service level: time to first token and inter-token latency, in milliseconds."""

    ttft_ms: float = attrs.field(validator=attrs.validators.gt(0.0))
    itl_ms: float = attrs.field(validator=attrs.validators.gt(0.0))


def _budget_at_least_minimum(instance: Bounds, _: attrs.Attribute[int], budget: int) -> None:
    if budget < instance.minimum:
        raise ValueError(f"budget {budget} is below minimum {instance.minimum}")


@attrs.frozen
class Bounds:
    """A pool's worker count stays within [minimum, budget]."""

    minimum: int = attrs.field(default=1, validator=attrs.validators.ge(0))
    budget: int = attrs.field(default=8, validator=_budget_at_least_minimum)

    def clamp(self, workers: float) -> tuple[int, Basis]:
        """``workers`` (a fraction counts as a whole worker) within the bounds, and why."""
        whole = math.ceil(workers - _SLACK)
        if whole < self.minimum:
            return self.minimum, "minimum"
        if whole > self.budget:
            return self.budget, "budget"
        return whole, "load"


class Need(msgspec.Struct, frozen=True, kw_only=True):
    """What the sizing rule asks of one pool for a load.

    ``exact``: the workers the load needs, before rounding and bounds; ``per_worker``: what one
    worker takes on (prefill: prompt tokens per second, the queueing bound applied; decode:
    concurrent requests); ``target_met``: false when no number of workers meets the target (one
    prefill alone takes longer than the TTFT target, or one request alone decodes slower than the
    ITL target): the pool is then sized by throughput alone.
    """

    role: Role
    workers: int
    basis: Basis
    exact: float
    per_worker: float
    target_met: bool


def prefill_need(load: Load, profile: PerformanceProfile, targets: Targets, bounds: Bounds) -> Need:
    """Prefill workers: the load's prompt tokens per second over what one worker prefills at its
    ISL, each worker kept busy only so far that the mean queueing (an M/D/1 queue's,
    ``rho * S / (2 * (1 - rho))`` for a prefill taking ``S``) fits in what the TTFT target leaves
    after the prefill itself."""
    service_s = profile.prefill_ms(load.isl) / 1000.0
    slack_s = targets.ttft_ms / 1000.0 - service_s
    # The utilisation whose mean wait is exactly the slack; with none left, throughput alone.
    utilisation = 2 * slack_s / (service_s + 2 * slack_s) if slack_s > 0 else 1.0
    per_worker = profile.prefill_throughput(load.isl) * utilisation
    exact = load.rate * load.isl / per_worker
    workers, basis = bounds.clamp(exact)
    return Need(
        role="prefill",
        workers=workers,
        basis=basis,
        exact=exact,
        per_worker=per_worker,
        target_met=slack_s > 0,
    )


def decode_need(load: Load, profile: PerformanceProfile, targets: Targets, bounds: Bounds) -> Need:
    """Decode workers: the largest concurrency one worker holds within the ITL target at the
    mean context of a decode (ISL + OSL / 2), and the concurrent decodes the load keeps going
    (Little's law: rate x OSL x that concurrency's ITL) over it."""
    context = load.isl + load.osl / 2
    concurrency = profile.max_concurrency(targets.itl_ms, context)
    met = concurrency > 0
    concurrency = max(concurrency, 1)
    decoding = load.rate * load.osl * profile.itl_ms(concurrency, context) / 1000.0
    exact = decoding / concurrency
    workers, basis = bounds.clamp(exact)
    return Need(
        role="decode",
        workers=workers,
        basis=basis,
        exact=exact,
        per_worker=float(concurrency),
        target_met=met,
    )
