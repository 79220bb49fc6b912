"""A counter and a histogram for the per-chunk path, updated without a lock.

prometheus_client's ``Counter.inc`` and ``Histogram.observe`` check the metric and take a lock
for each value (the histogram two): twelve Python calls per streamed chunk, about a seventh of
the root's Python calls per chunk (measured). The frontend updates these two series from the
event loop's thread only, so a plain addition does. Their exposition is prometheus_client's
(the same samples, labels and order, ``_created`` included unless prometheus_client's are turned
off), through a collector on the registry.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client import metrics as _metrics
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import INF, floatToGoString

__all__ = ["LoopCounter", "LoopHistogram"]

C = TypeVar("C")


class _CounterChild:
    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        """Add ``amount`` (not checked: callers add token counts, never negative)."""
        self.value += amount


class _HistogramChild:
    __slots__ = ("_bounds", "counts", "created", "sum")

    def __init__(self, bounds: list[float]) -> None:
        self._bounds = bounds
        self.counts = [0] * len(bounds)  # per bucket, not cumulative
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        # The first bucket whose bound is at least amount, as prometheus_client's ``<=``.
        self.counts[bisect_left(self._bounds, amount)] += 1
        self.sum += amount


class _Family(Collector, Generic[C]):
    """One metric family's children by label values, and its exposition."""

    kind = ""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], C] = {}
        registry.register(self)

    def labels(self, *values: str) -> C:
        """The child of these label values (made on first use)."""
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected {len(self.labelnames)} label values")
            child = self._children[values] = self._child()
        return child

    def _child(self) -> C:
        raise NotImplementedError

    def describe(self) -> Iterable[Metric]:
        return [Metric(self.name, self.documentation, self.kind)]

    def collect(self) -> Iterable[Metric]:
        metric = Metric(self.name, self.documentation, self.kind)
        for values, child in list(self._children.items()):
            self._samples(metric, dict(zip(self.labelnames, values, strict=True)), child)
        return [metric]

    def _samples(self, metric: Metric, labels: dict[str, str], child: C) -> None:
        raise NotImplementedError


class LoopCounter(_Family[_CounterChild]):
    """A counter (``<name>_total``) whose children are updated from one thread."""

    kind = "counter"

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        super().__init__(name.removesuffix("_total"), documentation, labelnames, registry)

    def _child(self) -> _CounterChild:
        return _CounterChild()

    def _samples(self, metric: Metric, labels: dict[str, str], child: _CounterChild) -> None:
        metric.add_sample(self.name + "_total", labels, child.value)
        if _created():
            metric.add_sample(self.name + "_created", labels, child.created)


class LoopHistogram(_Family[_HistogramChild]):
    """A histogram whose children are updated from one thread."""

    kind = "histogram"

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
        buckets: Sequence[float],
    ) -> None:
        bounds = sorted(float(b) for b in buckets)
        if bounds[-1] != INF:
            bounds.append(INF)
        self._bounds = bounds
        # The bounds as prometheus_client writes them ("+Inf", "0.005"), made once.
        self._les = [floatToGoString(b) for b in bounds]  # type: ignore[no-untyped-call]
        super().__init__(name, documentation, labelnames, registry)

    def _child(self) -> _HistogramChild:
        return _HistogramChild(self._bounds)

    def _samples(self, metric: Metric, labels: dict[str, str], child: _HistogramChild) -> None:
        total = 0.0
        for le, count in zip(self._les, list(child.counts), strict=True):
            total += count
            metric.add_sample(self.name + "_bucket", {**labels, "le": le}, total)
        metric.add_sample(self.name + "_count", labels, total)
        metric.add_sample(self.name + "_sum", labels, child.sum)
        if _created():
            metric.add_sample(self.name + "_created", labels, child.created)


def _created() -> bool:
    # prometheus_client's own switch (PROMETHEUS_DISABLE_CREATED_SERIES, disable_created_metrics).
    return bool(getattr(_metrics, "_use_created", True))
