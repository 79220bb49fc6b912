"""The performance profile: interpolation between measured points, flat beyond them, and its
JSON document."""

from __future__ import annotations

import msgspec
import pytest

from actors.serving.planner import decode_profile, encode_profile
from tests.planner._profiles import PROFILE


def test_prefill_interpolates_linearly_and_holds_flat_beyond() -> None:
    assert PROFILE.prefill_ms(1000) == 100.0
    assert PROFILE.prefill_ms(550) == pytest.approx(60.0)
    assert PROFILE.prefill_ms(10) == 20.0 and PROFILE.prefill_ms(9000) == 800.0
    assert PROFILE.prefill_throughput(1000) == pytest.approx(10_000.0)
    assert PROFILE.prefill_throughput(100) == pytest.approx(5_000.0)
    assert PROFILE.prefill_throughput(550) == pytest.approx(7_500.0)


def test_decode_itl_is_bilinear_between_measured_points() -> None:
    assert PROFILE.itl_ms(8, 4000) == 40.0
    assert PROFILE.itl_ms(4.5, 1000) == pytest.approx(15.0)
    assert PROFILE.itl_ms(4.5, 2500) == pytest.approx((10 + 20 + 20 + 40) / 4)
    assert PROFILE.itl_ms(64, 100_000) == 100.0


def test_max_concurrency_within_an_itl() -> None:
    assert PROFILE.max_concurrency(20.0, 1000) == 8
    assert PROFILE.max_concurrency(30.0, 1000) == 16  # 20 ms + 1.25 ms a request past 8
    assert PROFILE.max_concurrency(1000.0, 1000) == 32  # no more than was measured
    assert PROFILE.max_concurrency(15.0, 4000) == 0  # one request alone is slower


def test_the_json_document_round_trips() -> None:
    document = encode_profile(PROFILE)
    assert decode_profile(document) == PROFILE
    assert msgspec.json.decode(document)["prefill_isl"] == [100, 1000, 4000]


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("prefill_isl", [100, 100, 4000], "ascending"),
        ("decode_context", [], "ascending"),
        ("prefill_ttft_ms", [20.0], "one prefill_ttft_ms"),
        ("decode_itl_ms", [[10.0, 20.0, 50.0]], "rows"),
        ("prefill_ttft_ms", [0.0, 1.0, 2.0], "positive"),
    ],
)
def test_a_malformed_profile_is_refused(field: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        msgspec.structs.replace(PROFILE, **{field: value})
    document = msgspec.json.encode({**msgspec.structs.asdict(PROFILE), field: value})
    with pytest.raises(msgspec.ValidationError, match=match):
        decode_profile(document)
