"""Measuring a profile against a real mock engine (accelerated simulated time, a small grid): the
profile's shape, not its numbers; and the ``profile`` entry point."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest

from actors.serving.engines import MockEngineConfig, TimingModel
from actors.serving.planner import ProfileGrid, decode_profile, encode_profile, profile_mock
from actors.serving.planner.profile import main

# A small KV cache (4096 tokens), so that more requests decoding fill more of it and the mock's
# decode pass, which grows with the KV in use, slows down visibly.
CONFIG = MockEngineConfig(
    num_blocks=256,
    block_size=16,
    kv_bytes_per_block=256,
    max_running_requests=16,
    max_batch_tokens=2048,
    context_length=4096,
    weights_bytes=4096,
    cuda_graph_bytes=4096,
    device="cpu",
    timing=TimingModel(speedup=10.0),
    kv_events_endpoint=None,
    kv_events_replay_endpoint=None,
    metrics_endpoint=None,
)
GRID = ProfileGrid(
    isl=(64, 256, 1024), concurrency=(1, 4, 16), context=(64, 128), decode_tokens=16, repeats=1
)


async def test_a_mock_engines_profile_has_the_expected_shape() -> None:
    profile = await profile_mock(CONFIG, GRID)
    assert profile.prefill_isl == [64, 256, 1024] and profile.decode_concurrency == [1, 4, 16]
    throughput = [profile.prefill_throughput(isl) for isl in GRID.isl]
    # A pass's fixed cost dominates short prompts: longer ones prefill more tokens a second.
    assert all(t > 0 for t in throughput) and throughput[-1] > 2 * throughput[0]
    for row in np.asarray(profile.decode_itl_ms):
        assert np.all(row[1:] >= 0.75 * row[:-1])  # non-decreasing, within tolerance
        assert row[-1] > 1.5 * row[0]  # 16 requests fill much more of the KV cache than one
    assert decode_profile(encode_profile(profile)) == profile


async def test_an_instant_mock_engine_cannot_be_profiled() -> None:
    with pytest.raises(ValueError, match="instant"):
        await profile_mock(msgspec.structs.replace(CONFIG, timing=TimingModel(instant=True)), GRID)


async def test_too_few_decode_tokens_to_see_all_requests_decode_is_refused() -> None:
    # 16 prompts of 1024 tokens take 8 passes of 2048 to prefill: the first request is done long
    # before the last starts decoding.
    config = msgspec.structs.replace(CONFIG, num_blocks=2048)
    grid = ProfileGrid(isl=(64,), concurrency=(16,), context=(1024,), decode_tokens=4)
    with pytest.raises(ValueError, match="raise it"):
        await profile_mock(config, grid)


def test_the_profile_command_writes_a_profile(tmp_path: Path) -> None:
    config, out = tmp_path / "engine.json", tmp_path / "profile.json"
    config.write_bytes(msgspec.json.encode(CONFIG))
    main(
        [
            *("--config", str(config), "--speedup", "20", "--out", str(out)),
            *("--isl", "64,512", "--concurrency", "1,2", "--context", "64"),
            *("--decode-tokens", "8", "--repeats", "1"),
        ]
    )
    profile = decode_profile(out.read_bytes())
    assert profile.prefill_isl == [64, 512] and profile.decode_context == [64]
    assert "speed-up 20" in profile.engine


def test_a_grid_is_checked() -> None:
    with pytest.raises(ValueError, match="ascending"):
        ProfileGrid(isl=(512, 64))
    with pytest.raises(ValueError):
        ProfileGrid(decode_tokens=1)
