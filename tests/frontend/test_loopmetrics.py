"""The lock-free counter and histogram expose exactly what prometheus_client's would."""

from __future__ import annotations

import re
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from actors.frontend._loopmetrics import LoopCounter, LoopHistogram

BUCKETS = (0.001, 0.01, 0.1)


def _record(histogram: Any, counter: Any) -> None:
    # Values below, on and above bounds, and one past the last (the +Inf bucket).
    for value in (0.0005, 0.001, 0.005, 0.01, 0.05, 2.0):
        histogram.labels("a").observe(value)
    histogram.labels("b").observe(0.002)
    counter.labels("a").inc(3)
    counter.labels("a").inc()
    counter.labels("b").inc(0)


def _registry(loop: bool) -> CollectorRegistry:
    registry = CollectorRegistry()
    hist_type: Any = LoopHistogram if loop else Histogram
    count_type: Any = LoopCounter if loop else Counter
    histogram = hist_type("x_seconds", "Latency.", ["model"], registry=registry, buckets=BUCKETS)
    counter = count_type("x_tokens", "Tokens.", ["model"], registry=registry)
    _record(histogram, counter)
    return registry


def _masked(text: bytes) -> str:
    # Creation times differ between the two registries; everything else must not.
    return re.sub(r"(_created\{[^}]*\}) \S+", r"\1 T", text.decode())


@pytest.mark.parametrize("generate", [generate_latest, generate_openmetrics])
def test_exposition_matches_prometheus_client(generate: Any) -> None:
    ours, theirs = _masked(generate(_registry(True))), _masked(generate(_registry(False)))
    assert "_created" in ours
    assert ours == theirs


def test_sample_values() -> None:
    registry = _registry(True)
    assert registry.get_sample_value("x_tokens_total", {"model": "a"}) == 4
    assert registry.get_sample_value("x_seconds_count", {"model": "a"}) == 6
    assert registry.get_sample_value("x_seconds_bucket", {"model": "a", "le": "0.01"}) == 4
    assert registry.get_sample_value("x_seconds_sum", {"model": "b"}) == 0.002


def test_names_are_registered() -> None:
    registry = _registry(True)
    with pytest.raises(ValueError, match="Duplicated"):
        Counter("x_tokens", "Again.", registry=registry)
    with pytest.raises(ValueError, match="Duplicated"):
        Histogram("x_seconds", "Again.", registry=registry)


def test_wrong_label_count() -> None:
    counter = LoopCounter("y", "Y.", ["model"], registry=CollectorRegistry())
    with pytest.raises(ValueError, match="label values"):
        counter.labels("a", "b")
