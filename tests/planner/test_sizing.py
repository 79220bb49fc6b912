"""The sizing rule: prefill workers by throughput with the TTFT target bounding the queueing,
decode workers by the concurrency that meets the ITL target, within the pool's bounds."""

from __future__ import annotations

import pytest

from actors.serving.planner import Bounds, Load, Targets, decode_need, prefill_need
from tests.planner._profiles import PROFILE

BOUNDS = Bounds(minimum=1, budget=64)
# 25 requests a second of 1000 prompt tokens: 25k tokens/s, a worker prefills 10k/s in 100 ms.
PREFILL_LOAD = Load(rate=25.0, isl=1000.0, osl=400.0)


def test_prefill_workers_keep_the_mean_queueing_within_the_ttft_target() -> None:
    need = prefill_need(PREFILL_LOAD, PROFILE, Targets(ttft_ms=300.0, itl_ms=20.0), BOUNDS)
    utilisation, service_s = need.per_worker / 10_000.0, 0.1
    wait_s = utilisation * service_s / (2 * (1 - utilisation))  # M/D/1
    assert service_s + wait_s == pytest.approx(0.3)
    assert need.exact == pytest.approx(25_000.0 / need.per_worker)
    assert (need.role, need.workers, need.basis, need.target_met) == ("prefill", 4, "load", True)


def test_a_tighter_ttft_target_needs_more_prefill_workers() -> None:
    counts = [
        prefill_need(PREFILL_LOAD, PROFILE, Targets(ttft_ms=ttft, itl_ms=20.0), BOUNDS).workers
        for ttft in (1000.0, 300.0, 150.0, 110.0)
    ]
    assert counts == sorted(counts) and counts[0] < counts[-1]
    assert counts[2] == 5  # utilisation 1/2: exactly 5.0 workers, not 6


def test_an_unreachable_ttft_target_sizes_prefill_by_throughput_alone() -> None:
    need = prefill_need(PREFILL_LOAD, PROFILE, Targets(ttft_ms=50.0, itl_ms=20.0), BOUNDS)
    assert not need.target_met
    assert need.per_worker == pytest.approx(10_000.0) and need.workers == 3


def test_decode_workers_by_the_concurrency_that_meets_the_itl_target() -> None:
    # Context 800 + 400 / 2 = 1000 tokens: 8 requests a worker at 20 ms; 10 requests a second of
    # 400 tokens at 20 ms keep 80 decoding.
    load = Load(rate=10.0, isl=800.0, osl=400.0)
    need = decode_need(load, PROFILE, Targets(ttft_ms=300.0, itl_ms=20.0), BOUNDS)
    assert (need.role, need.per_worker, need.workers, need.target_met) == ("decode", 8, 10, True)
    looser = decode_need(load, PROFILE, Targets(ttft_ms=300.0, itl_ms=50.0), BOUNDS)
    assert looser.per_worker == 32 and looser.workers < need.workers


def test_an_unreachable_itl_target_decodes_one_request_a_worker() -> None:
    load = Load(rate=10.0, isl=800.0, osl=400.0)
    need = decode_need(load, PROFILE, Targets(ttft_ms=300.0, itl_ms=5.0), Bounds(budget=16))
    assert not need.target_met and need.per_worker == 1
    assert need.exact == pytest.approx(40.0)  # 10 x 400 x 10 ms
    assert (need.workers, need.basis) == (16, "budget")


def test_the_bounds_clamp_and_say_so() -> None:
    targets = Targets(ttft_ms=300.0, itl_ms=20.0)
    idle = Load(rate=0.0, isl=0.0, osl=0.0)
    assert prefill_need(idle, PROFILE, targets, Bounds(minimum=2, budget=4)).basis == "minimum"
    assert decode_need(idle, PROFILE, targets, Bounds(minimum=0, budget=4)).workers == 0
    busy = Load(rate=1000.0, isl=1000.0, osl=400.0)
    need = prefill_need(busy, PROFILE, targets, Bounds(minimum=2, budget=4))
    assert (need.workers, need.basis) == (4, "budget") and need.exact > 4
    assert Bounds().clamp(3.0000000001) == (3, "load")
    with pytest.raises(ValueError, match="below minimum"):
        Bounds(minimum=3, budget=2)
    with pytest.raises(ValueError):
        Targets(ttft_ms=0.0, itl_ms=20.0)
