"""The planner's core: predict each interval's load, size the prefill and decode pools for it
from an engine's performance profile (Dynamo's SLA planner's rule), damp the scale-downs, or,
with no profile, scale on queue and KV watermarks. Every decision is a typed record with its
reason. Driving the pools' scaling from these decisions is not wired yet.

- predictors (:func:`predictor` by name): ``constant``, ``moving_average``, ``holt`` (trend) and
  ``seasonal_naive`` (period), each over one series; :func:`forecast` predicts a :class:`Load`;
- :class:`PerformanceProfile`: prefill TTFT / throughput by ISL, decode ITL by concurrency and
  context length, interpolated; a JSON document (:func:`encode_profile`, :func:`decode_profile`);
- :func:`prefill_need` / :func:`decode_need`: the sizing rule; :class:`Damper`: the hysteresis;
  :class:`Planner`: both over the observed intervals; :class:`WatermarkScaler`: the mode that
  needs no profile;
- :func:`measure_profile` times any engine through the engine contract, :func:`profile_mock` a
  mock engine; ``python -m actors.serving.planner.profile`` writes a mock engine's profile.
"""

from actors.serving.planner._decide import Action, Damper, Decision, Hysteresis
from actors.serving.planner._measure import ProfileGrid, measure_profile, profile_mock
from actors.serving.planner._planner import Plan, Planner, PlannerConfig
from actors.serving.planner._predict import (
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
from actors.serving.planner._profile import PerformanceProfile, decode_profile, encode_profile
from actors.serving.planner._sizing import (
    Basis,
    Bounds,
    Need,
    Role,
    Targets,
    decode_need,
    prefill_need,
)
from actors.serving.planner._watermark import PoolLoad, Watermarks, WatermarkScaler

__all__ = [
    "PREDICTORS",
    "Action",
    "Basis",
    "Bounds",
    "Constant",
    "Damper",
    "Decision",
    "Holt",
    "Hysteresis",
    "Load",
    "MovingAverage",
    "Need",
    "PerformanceProfile",
    "Plan",
    "Planner",
    "PlannerConfig",
    "PoolLoad",
    "Predictor",
    "ProfileGrid",
    "Role",
    "SeasonalNaive",
    "Targets",
    "WatermarkScaler",
    "Watermarks",
    "decode_need",
    "decode_profile",
    "encode_profile",
    "forecast",
    "measure_profile",
    "predictor",
    "prefill_need",
    "profile_mock",
]
