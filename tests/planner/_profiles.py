"""A hand-made performance profile the planner tests share."""

from __future__ import annotations

from actors.serving.planner import PerformanceProfile

# Prefill: 10k tokens/s at 1000 tokens. Decode ITL (ms) rows per context, columns per
# concurrency: slower with more requests and with longer contexts.
PROFILE = PerformanceProfile(
    engine="hand-made",
    prefill_isl=[100, 1000, 4000],
    prefill_ttft_ms=[20.0, 100.0, 800.0],
    decode_concurrency=[1, 8, 32],
    decode_context=[1000, 4000],
    decode_itl_ms=[[10.0, 20.0, 50.0], [20.0, 40.0, 100.0]],
)
