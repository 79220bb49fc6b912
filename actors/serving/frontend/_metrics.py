"""Frontend Prometheus metrics, in the spirit of Dynamo's ``dynamo_frontend_*`` families.

All live on the registry the caller passes in (the process's telemetry registry), prefixed
``actorserve_frontend_``. ``model`` is the served model's name, or ``""`` when the request named
no served model (so bad requests cannot blow up the label cardinality).
"""

from __future__ import annotations

import itertools
import math
import time
import weakref
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

__all__ = ["FrontendMetrics", "RequestMetrics"]

_PREFIX = "actorserve_frontend"

# Latency buckets from sub-millisecond (mock engines, cached prefixes) to minutes (long answers).
_TTFT_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
)  # fmt: skip
_ITL_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
)  # fmt: skip
_DURATION_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_TOKEN_BUCKETS = (1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
#: A request adds its streamed tokens to ``output_tokens`` in steps of at least this many (and the
#: rest when it ends): one locked update per step instead of one per output (four Python calls
#: and a lock per streamed chunk). The counter lags a running request by fewer tokens than this.
OUTPUT_TOKENS_STEP = 32
#: How prometheus_client writes a bucket's bound (``1.0``, ``+Inf``); untyped there.
_le = cast(Callable[[float], str], floatToGoString)


class FrontendMetrics:
    """The frontend's metric families, registered once on ``registry``.

    :meth:`on` returns the families already registered there, so a restarted frontend (or a
    second app in one process) shares them instead of failing on duplicate metrics.
    """

    _by_registry: ClassVar[weakref.WeakKeyDictionary[CollectorRegistry, FrontendMetrics]] = (
        weakref.WeakKeyDictionary()
    )

    @classmethod
    def on(cls, registry: CollectorRegistry) -> FrontendMetrics:
        metrics = cls._by_registry.get(registry)
        if metrics is None:
            metrics = cls._by_registry[registry] = cls(registry)
        return metrics

    def __init__(self, registry: CollectorRegistry) -> None:
        def name(n: str) -> str:
            return f"{_PREFIX}_{n}"

        self.requests = Counter(
            name("requests"),
            "Requests finished, by outcome (status: success, error, cancelled).",
            ["model", "endpoint", "request_type", "status", "error_type"],
            registry=registry,
        )
        self.active = Gauge(
            name("active_requests"),
            "Requests being served now.",
            ["model"],
            registry=registry,
        )
        self.ttft = Histogram(
            name("time_to_first_token_seconds"),
            "From the request's arrival to its first generated text.",
            ["model"],
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.itl = LoopHistogram(
            name("inter_token_latency_seconds"),
            "Time between streamed outputs, per token.",
            "model",
            _ITL_BUCKETS,
            registry,
        )
        self.duration = Histogram(
            name("request_duration_seconds"),
            "From the request's arrival to its last byte.",
            ["model"],
            buckets=_DURATION_BUCKETS,
            registry=registry,
        )
        self.input_tokens = Histogram(
            name("input_sequence_tokens"),
            "Prompt length in tokens.",
            ["model"],
            buckets=_TOKEN_BUCKETS,
            registry=registry,
        )
        self.output_tokens_hist = Histogram(
            name("output_sequence_tokens"),
            "Generated tokens per request.",
            ["model"],
            buckets=_TOKEN_BUCKETS,
            registry=registry,
        )
        self.output_tokens = Counter(
            name("output_tokens"),
            f"Generated tokens, counted as they stream (a running request's in steps of "
            f"{OUTPUT_TOKENS_STEP}, the rest when it ends).",
            ["model"],
            registry=registry,
        )
        self.disconnected = Counter(
            name("disconnected_clients"),
            "Clients that went away before their response was complete.",
            ["model"],
            registry=registry,
        )

        # Label children resolved once: a labels() lookup costs more than the update itself.
        self._series: dict[str, _ModelSeries] = {}
        self._outcomes: dict[tuple[str, str, str, str, str], Any] = {}

    def start(self, endpoint: str) -> RequestMetrics:
        """Begin measuring one request (its clock starts now)."""
        return RequestMetrics(self, endpoint)

    def series(self, model: str) -> _ModelSeries:
        """The per-model series of ``model`` (a served model: the cache stays small)."""
        series = self._series.get(model)
        if series is None:
            series = self._series[model] = _ModelSeries(self, model)
        return series

    def outcome(
        self, model: str, endpoint: str, request_type: str, status: str, error_type: str
    ) -> Any:
        """The ``requests`` counter of one outcome (few: the labels take few values)."""
        key = (model, endpoint, request_type, status, error_type)
        child = self._outcomes.get(key)
        if child is None:
            child = self._outcomes[key] = self.requests.labels(*key)
        return child


class LoopHistogram(Collector):
    """A histogram for the per-chunk path, observed from the event loop's thread only (the
    frontend's, which also renders ``/metrics``): no lock, and one bisect per observation instead
    of prometheus_client's Python walk over the buckets and two locked updates (the root's
    Python calls per streamed chunk went from 56 to 49). Exposed as a one-label ``Histogram``
    is: the same name, type, buckets and samples, less ``_created``."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelname: str,
        buckets: tuple[float, ...],
        registry: CollectorRegistry,
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labelname = labelname
        self._bounds = (*buckets, math.inf)
        self._series: dict[str, LoopHistogramSeries] = {}
        registry.register(self)

    def labels(self, value: str) -> LoopHistogramSeries:
        series = self._series.get(value)
        if series is None:
            series = self._series[value] = LoopHistogramSeries(self._bounds)
        return series

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self._name, self._documentation, labels=[self._labelname])

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield self._family()

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = self._family()
        bounds = [_le(bound) for bound in self._bounds]
        for value, series in self._series.items():
            cumulative = itertools.accumulate(series.counts)
            family.add_metric([value], list(zip(bounds, cumulative, strict=True)), series.sum)
        yield family


class LoopHistogramSeries:
    """One label value's buckets of a :class:`LoopHistogram`."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * len(bounds)  # per bucket, not cumulative
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self._bounds, amount)] += 1
        self.sum += amount


class _ModelSeries:
    __slots__ = (
        "active",
        "disconnected",
        "duration",
        "input_tokens",
        "itl",
        "output_tokens",
        "output_tokens_hist",
        "ttft",
    )

    def __init__(self, m: FrontendMetrics, model: str) -> None:
        self.active = m.active.labels(model)
        self.input_tokens = m.input_tokens.labels(model)
        self.ttft = m.ttft.labels(model)
        self.itl = m.itl.labels(model)
        self.output_tokens = m.output_tokens.labels(model)
        self.duration = m.duration.labels(model)
        self.output_tokens_hist = m.output_tokens_hist.labels(model)
        self.disconnected = m.disconnected.labels(model)


class RequestMetrics:
    """One request's measurements; :meth:`done` records its outcome exactly once."""

    __slots__ = (
        "_counted",
        "_done",
        "_last",
        "_m",
        "_output",
        "_series",
        "endpoint",
        "first_token_at",
        "model",
        "request_type",
        "started",
    )

    def __init__(self, metrics: FrontendMetrics, endpoint: str) -> None:
        self._m = metrics
        self.endpoint = endpoint
        self.model = ""
        self.request_type = ""
        self.started = time.perf_counter()
        self.first_token_at: float | None = None
        self._last = self.started
        self._output = 0
        self._counted = 0  # of _output, what the output_tokens counter has
        self._done = False
        self._series: _ModelSeries | None = None

    def admitted(self, model: str, request_type: str, prompt_tokens: int) -> None:
        """The request names a served model and was tokenised: it now counts as in flight."""
        self.model = model
        self.request_type = request_type
        series = self._series = self._m.series(model)
        series.active.inc()
        series.input_tokens.observe(prompt_tokens)

    def tokens(self, n: int) -> None:
        """``n`` new tokens arrived (the hot path: one metric update, and a counter step now and
        then)."""
        series = self._series
        if n <= 0 or series is None:
            return
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
            series.ttft.observe(now - self.started)
        else:
            series.itl.observe((now - self._last) / n)
        self._last = now
        output = self._output = self._output + n
        if output - self._counted >= OUTPUT_TOKENS_STEP:
            series.output_tokens.inc(output - self._counted)
            self._counted = output

    def done(self, status: str, error_type: str = "", *, disconnected: bool = False) -> bool:
        """Record the outcome (``success``, ``error`` or ``cancelled``) once; later calls are
        no-ops. True when this call ended a request that :meth:`admitted` had counted in flight.
        """
        if self._done:
            return False
        self._done = True
        self._m.outcome(self.model, self.endpoint, self.request_type, status, error_type).inc()
        series = self._series
        if series is None:
            return False  # never admitted: nothing else was started for it
        series.active.dec()
        if self._output > self._counted:
            series.output_tokens.inc(self._output - self._counted)
            self._counted = self._output
        series.duration.observe(time.perf_counter() - self.started)
        series.output_tokens_hist.observe(self._output)
        if disconnected:
            series.disconnected.inc()
        return True
