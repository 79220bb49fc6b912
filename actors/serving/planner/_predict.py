"""Load predictors: each predicts a series' next value from the values observed so far, and a
load (request rate, mean ISL, mean OSL) as the three series' next values."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import attrs
import msgspec
import numpy as np
from numpy.typing import NDArray

__all__ = [
    "PREDICTORS",
    "Constant",
    "Holt",
    "Load",
    "MovingAverage",
    "Predictor",
    "SeasonalNaive",
    "forecast",
    "predictor",
]


class Load(msgspec.Struct, frozen=True, kw_only=True):
    """One interval's load, observed or predicted: requests per second and their mean input and
    output lengths in tokens."""

    rate: float
    isl: float
    osl: float

    def __post_init__(self) -> None:
        if min(self.rate, self.isl, self.osl) < 0:
            raise ValueError(f"a load is never negative: {self}")


@attrs.frozen
class _Rule(abc.ABC):
    """What every predictor shares: the checks on the series and a floor at zero, since a rate or
    a length is never negative (a falling trend would otherwise predict one)."""

    def predict(self, series: Sequence[float]) -> float:
        """The value after the last of ``series`` (oldest first; at least one value)."""
        values = np.asarray(series, dtype=np.float64)
        if values.ndim != 1 or values.size == 0:
            raise ValueError("a prediction needs a series of at least one observation")
        return max(0.0, self._next(values))

    @abc.abstractmethod
    def _next(self, values: NDArray[np.float64]) -> float:
        """The prediction, before the floor."""


@attrs.frozen
class Constant(_Rule):
    """The last value again: follows a step at once, lags a ramp by one interval's rise."""

    def _next(self, values: NDArray[np.float64]) -> float:
        return float(values[-1])


@attrs.frozen
class MovingAverage(_Rule):
    """The mean of the last ``window`` values: smooths noise, lags a ramp by (window - 1) / 2
    intervals' rise and a step by up to ``window`` intervals."""

    window: int = attrs.field(default=5, validator=attrs.validators.ge(1))

    def _next(self, values: NDArray[np.float64]) -> float:
        return float(values[-self.window :].mean())


@attrs.frozen
class Holt(_Rule):
    """Double exponential smoothing (Holt's linear trend): a level and a trend, each smoothed
    (``alpha``, ``beta``), predicting level + trend; follows a ramp with no lag once the trend is
    learnt, and overshoots a step for a few intervals."""

    alpha: float = attrs.field(
        default=0.5, validator=[attrs.validators.gt(0.0), attrs.validators.le(1.0)]
    )
    beta: float = attrs.field(
        default=0.3, validator=[attrs.validators.ge(0.0), attrs.validators.le(1.0)]
    )

    def _next(self, values: NDArray[np.float64]) -> float:
        level = float(values[0])
        trend = float(values[1] - values[0]) if values.size > 1 else 0.0
        for value in values[1:]:
            previous = level
            level = self.alpha * float(value) + (1 - self.alpha) * (level + trend)
            trend = self.beta * (level - previous) + (1 - self.beta) * trend
        return level + trend


@attrs.frozen
class SeasonalNaive(_Rule):
    """The value one ``period`` ago (a daily cycle of intervals, say): exact on a load that
    repeats; the last value until a whole period has been seen."""

    period: int = attrs.field(default=24, validator=attrs.validators.ge(1))

    def _next(self, values: NDArray[np.float64]) -> float:
        return float(values[-self.period] if values.size >= self.period else values[-1])


Predictor = Constant | MovingAverage | Holt | SeasonalNaive

PREDICTORS: dict[str, type[Predictor]] = {
    "constant": Constant,
    "moving_average": MovingAverage,
    "holt": Holt,
    "seasonal_naive": SeasonalNaive,
}


def predictor(name: str, **params: Any) -> Predictor:
    """The predictor called ``name`` (a key of :data:`PREDICTORS`) with its parameters."""
    try:
        kind = PREDICTORS[name]
    except KeyError:
        raise ValueError(f"no predictor {name!r}; one of {sorted(PREDICTORS)}") from None
    return kind(**params)


def forecast(history: Sequence[Load], rule: Predictor) -> Load:
    """The next interval's load: ``rule`` applied to each of the three series of ``history``
    (oldest first)."""
    return Load(
        rate=rule.predict([load.rate for load in history]),
        isl=rule.predict([load.isl for load in history]),
        osl=rule.predict([load.osl for load in history]),
    )
