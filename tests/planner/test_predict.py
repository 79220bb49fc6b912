"""The load predictors on synthetic series: each behaves as its docstring says, measured as the
error of its one-step-ahead predictions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from actors.serving.planner import (
    PREDICTORS,
    Constant,
    Holt,
    Load,
    MovingAverage,
    Predictor,
    SeasonalNaive,
    forecast,
    predictor,
)

SLOPE = 2.0
RAMP = [10 + SLOPE * t for t in range(40)]
STEP = [10.0] * 20 + [50.0] * 20
PERIOD = 8
PERIODIC = [20 + 10 * math.sin(2 * math.pi * t / PERIOD) for t in range(6 * PERIOD)]


def errors(rule: Predictor, series: list[float], start: int = 1) -> list[float]:
    """The error of predicting each value from the values before it, from ``start`` on."""
    return [abs(rule.predict(series[:t]) - series[t]) for t in range(start, len(series))]


def test_constant_predicts_the_last_value() -> None:
    assert Constant().predict([3.0, 7.0, 5.0]) == 5.0
    assert errors(Constant(), RAMP) == pytest.approx([SLOPE] * (len(RAMP) - 1))


def test_moving_average_lags_a_ramp_by_half_its_window() -> None:
    window = 5
    late = errors(MovingAverage(window), RAMP, start=window)
    assert late == pytest.approx([SLOPE * (window + 1) / 2] * len(late))


def test_moving_average_smooths_noise_better_than_the_last_value() -> None:
    noisy = (20 + np.random.default_rng(7).normal(0, 3, 200)).tolist()
    assert np.mean(errors(MovingAverage(8), noisy, 8)) < np.mean(errors(Constant(), noisy, 8))


def test_holt_follows_a_ramp_that_the_constant_lags() -> None:
    holt, constant = errors(Holt(), RAMP), errors(Constant(), RAMP)
    assert np.mean(holt) < np.mean(constant) / 4
    assert holt[-1] < 0.01 * SLOPE  # the trend learnt: no lag left


def test_a_step_the_constant_takes_at_once_the_average_after_its_window_holt_overshoots() -> None:
    step_at = STEP.index(50.0)
    constant = errors(Constant(), STEP)
    assert [i + 1 for i, e in enumerate(constant) if e] == [step_at]
    window = 4
    average = errors(MovingAverage(window), STEP)
    assert max(average[step_at + window - 1 :]) == 0 < min(average[step_at - 1 : step_at + 3])
    holt = [Holt().predict(STEP[:t]) for t in range(step_at + 1, len(STEP))]
    assert max(holt) > 50.0  # overshoots
    assert holt[-1] == pytest.approx(50.0, abs=1.0)  # and settles


def test_seasonal_naive_repeats_a_period_the_others_miss() -> None:
    seasonal = errors(SeasonalNaive(PERIOD), PERIODIC, start=PERIOD)
    assert max(seasonal) == pytest.approx(0.0, abs=1e-9)
    for other in (Constant(), MovingAverage(3), Holt()):
        assert np.mean(errors(other, PERIODIC, PERIOD)) > 1.0
    # Until a whole period is seen, the last value.
    assert SeasonalNaive(PERIOD).predict(PERIODIC[:3]) == PERIODIC[2]


def test_predictions_are_never_negative() -> None:
    assert Holt(alpha=1.0, beta=1.0).predict([20.0, 10.0, 0.0]) == 0.0


def test_predictors_by_name() -> None:
    assert set(PREDICTORS) == {"constant", "moving_average", "holt", "seasonal_naive"}
    assert predictor("moving_average", window=3) == MovingAverage(3)
    assert predictor("holt", alpha=0.2, beta=0.1) == Holt(0.2, 0.1)
    with pytest.raises(ValueError, match="no predictor"):
        predictor("prophet")
    with pytest.raises(ValueError):
        predictor("moving_average", window=0)
    with pytest.raises(ValueError, match="at least one"):
        Constant().predict([])


def test_forecast_predicts_each_series_of_a_load() -> None:
    history = [Load(rate=r, isl=100 * r, osl=10.0) for r in (1.0, 2.0, 3.0)]
    assert forecast(history, Constant()) == Load(rate=3.0, isl=300.0, osl=10.0)
    ahead = forecast(history, Holt(alpha=1.0, beta=1.0))
    assert (ahead.rate, ahead.isl, ahead.osl) == pytest.approx((4.0, 400.0, 10.0))
    with pytest.raises(ValueError, match="never negative"):
        Load(rate=-1.0, isl=1.0, osl=1.0)
