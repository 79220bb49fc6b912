"""An engine's performance profile: prefill time by input length, decode inter-token latency by
concurrency and context length, measured at a few points and interpolated linearly between them
(flat beyond the outermost points)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import msgspec
import numpy as np
from numpy.typing import NDArray

__all__ = ["PerformanceProfile", "check_axis", "decode_profile", "encode_profile"]


def check_axis(name: str, axis: Sequence[int]) -> None:
    """Refuse an axis of measured points that is empty, not positive or not strictly ascending."""
    if not axis or axis[0] <= 0 or any(b <= a for a, b in itertools.pairwise(axis)):
        raise ValueError(f"{name} must be positive and strictly ascending: {axis}")


class PerformanceProfile(msgspec.Struct, frozen=True, kw_only=True):
    """What :func:`~actors.serving.planner.measure_profile` measured of one engine (one worker).

    ``prefill_ttft_ms[i]``: the time to first token of one request of ``prefill_isl[i]`` tokens
    on an idle engine. ``decode_itl_ms[i][j]``: the inter-token latency of
    ``decode_concurrency[j]`` requests decoding together at a context of ``decode_context[i]``
    tokens. Axes ascend strictly.
    """

    engine: str  # what was measured, for people
    prefill_isl: list[int]
    prefill_ttft_ms: list[float]
    decode_concurrency: list[int]
    decode_context: list[int]
    decode_itl_ms: list[list[float]]

    def __post_init__(self) -> None:
        for name, axis in (
            ("prefill_isl", self.prefill_isl),
            ("decode_concurrency", self.decode_concurrency),
            ("decode_context", self.decode_context),
        ):
            check_axis(name, axis)
        if len(self.prefill_ttft_ms) != len(self.prefill_isl):
            raise ValueError("one prefill_ttft_ms per prefill_isl")
        shape = (len(self.decode_context), len(self.decode_concurrency))
        if np.shape(self.decode_itl_ms) != shape:
            raise ValueError(f"decode_itl_ms must be {shape[0]} rows of {shape[1]}")
        if min(self.prefill_ttft_ms) <= 0 or np.min(self.decode_itl_ms) <= 0:
            raise ValueError("measured times must be positive")

    def prefill_ms(self, isl: float) -> float:
        """The time to first token of one ``isl``-token request on an idle worker."""
        return float(np.interp(isl, self.prefill_isl, self.prefill_ttft_ms))

    def prefill_throughput(self, isl: float) -> float:
        """Prompt tokens per second one worker prefills at ``isl`` tokens a request."""
        measured = np.asarray(self.prefill_isl) / np.asarray(self.prefill_ttft_ms) * 1000.0
        return float(np.interp(isl, self.prefill_isl, measured))

    def itl_ms(self, concurrency: float, context: float) -> float:
        """The inter-token latency of ``concurrency`` requests decoding at ``context`` tokens."""
        return float(self._itl_at(np.asarray([concurrency], dtype=np.float64), context)[0])

    def max_concurrency(self, itl_ms: float, context: float) -> int:
        """The most requests (up to the largest measured) one worker decodes at ``context``
        tokens within ``itl_ms`` a token; 0 when even one request is slower."""
        candidates = np.arange(1, self.decode_concurrency[-1] + 1, dtype=np.float64)
        within = np.flatnonzero(self._itl_at(candidates, context) <= itl_ms)
        return int(candidates[within[-1]]) if within.size else 0

    def _itl_at(self, concurrency: NDArray[np.float64], context: float) -> NDArray[np.float64]:
        # Bilinear: along concurrency within each measured context, then across contexts.
        rows = np.array(
            [np.interp(concurrency, self.decode_concurrency, row) for row in self.decode_itl_ms]
        )
        return np.array([np.interp(context, self.decode_context, col) for col in rows.T])


def encode_profile(profile: PerformanceProfile) -> bytes:
    """The profile as a JSON document."""
    return msgspec.json.format(msgspec.json.encode(profile), indent=2)


def decode_profile(data: bytes | str) -> PerformanceProfile:
    """A profile from its JSON document, checked as one built in code is."""
    return msgspec.json.decode(data, type=PerformanceProfile)
