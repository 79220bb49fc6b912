"""The publisher actor: the engine's load metrics and KV events, to Prometheus and the router.

It subscribes to the engine's ZMQ sockets (one KV-event subscription per data-parallel rank,
recovering gaps through the replay socket) and hands what it reads to a :class:`WorkerSink`
(the routing table). Under the worker's one_for_all supervisor it restarts with the engine and
then subscribes to the new engine's endpoints.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import anyio
from prometheus_client import Counter, Gauge
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from actors import Actor, ActorRef, current_registry
from actors.serving.engines import SGLangMetricsReader
from actors.serving.worker._subscribe import KvEventSubscriber, KvMetricsSubscriber
from actors.telemetry import REGISTRY
from protocols import control
from protocols.engine import Capacity

__all__ = ["Publisher", "WorkerSink"]

_labels = ["worker", "dp_rank"]
TOTAL_BLOCKS = Gauge(
    "actorserve_worker_total_blocks", "KV blocks of the engine.", _labels, registry=REGISTRY
)
# A ratio named for no device, since mock and HF workers keep their KV cache on the CPU.
CACHE_USAGE = Gauge(
    "actorserve_worker_kv_cache_usage_ratio",
    "Fraction of KV blocks in use (0-1).",
    _labels,
    registry=REGISTRY,
)
ACTIVE = Gauge("actorserve_worker_active_requests", "Requests running.", _labels, registry=REGISTRY)
WAITING = Gauge(
    "actorserve_worker_waiting_requests", "Requests queued.", _labels, registry=REGISTRY
)
KV_EVENTS = Counter(
    "actorserve_worker_kv_event_batches", "KV event batches received.", _labels, registry=REGISTRY
)


#: What an engine's own figures (``EngineStats.counters`` / ``histograms``) mean, by name.
FIGURES = {
    "embedding_batches": "Forward passes of an embedding engine.",
    "embedding_requests": "Inputs an embedding engine answered with a vector.",
    "embedding_batch_size": "Inputs per forward pass of an embedding engine.",
    "embedding_input_tokens": "Tokens per input of an embedding engine.",
    "image_steps": "Denoising steps an image engine ran (a cancelled image stops early).",
    "images": "Images an image engine finished.",
    "images_cancelled": "Images cancelled before their last step.",
}
#: How often a worker whose engine keeps figures of its own is asked for them.
FIGURES_INTERVAL_S = 2.0


class _Figures(Collector):
    """The engines' own figures, as each worker's publisher last read them."""

    def __init__(self) -> None:
        self.by_worker: dict[str, control.EngineStats] = {}

    def collect(self) -> Iterator[Metric]:
        counters: dict[str, CounterMetricFamily] = {}
        histograms: dict[str, HistogramMetricFamily] = {}
        for worker, stats in sorted(self.by_worker.items()):
            for name, value in stats.counters.items():
                family = counters.get(name)
                if family is None:
                    family = counters[name] = CounterMetricFamily(
                        f"actorserve_worker_{name}", FIGURES.get(name, name), labels=["worker"]
                    )
                family.add_metric([worker], value)
            for name, h in stats.histograms.items():
                hist = histograms.get(name)
                if hist is None:
                    hist = histograms[name] = HistogramMetricFamily(
                        f"actorserve_worker_{name}", FIGURES.get(name, name), labels=["worker"]
                    )
                hist.add_metric([worker], h.cumulative(), h.sum)
        yield from counters.values()
        yield from histograms.values()


_FIGURES = _Figures()
REGISTRY.register(_FIGURES)


class WorkerSink(Protocol):
    """Where a publisher hands what it reads (the router's view of the worker)."""

    def load(self, worker_id: str, dp_rank: int, metrics: Any) -> None: ...

    def kv_events(self, worker_id: str, dp_rank: int, batch: Any) -> None: ...


class Publisher(Actor):
    def __init__(self, worker_id: str, engine_name: str, sink: WorkerSink | None = None) -> None:
        self.worker_id = worker_id
        self.engine_name = engine_name
        self.sink = sink
        self.batches = 0
        self._subscribers: list[KvEventSubscriber | KvMetricsSubscriber | SGLangMetricsReader] = []

    async def started(self) -> None:
        engine: ActorRef[Any] | None = current_registry().whereis(self.engine_name)
        if engine is None:
            raise LookupError(f"no engine registered as {self.engine_name!r}")
        capacity: Capacity = await engine.ask(control.GetCapacity())
        for rank in range(capacity.dp_size):
            # Dynamo publishes zeros first so the gauges exist before the first scheduler tick.
            TOTAL_BLOCKS.labels(self.worker_id, str(rank)).set(capacity.total_kv_blocks)
            CACHE_USAGE.labels(self.worker_id, str(rank)).set(0)
        replays = capacity.kv_events_replay_endpoints
        for rank, endpoint in enumerate(capacity.kv_events_endpoints):
            replay = replays[rank] if rank < len(replays) else None
            self.start_soon(
                self._events, rank, endpoint, replay, name=f"{self.worker_id} kv events {rank}"
            )
        if capacity.metrics_endpoint is not None:
            reader = (
                SGLangMetricsReader(capacity.metrics_endpoint, page_size=capacity.block_size)
                if capacity.metrics_pushed
                else KvMetricsSubscriber(capacity.metrics_endpoint)
            )
            self.start_soon(self._metrics, reader, name=f"{self.worker_id} metrics")
        stats: control.EngineStats = await engine.ask(control.GetStats())
        if stats.counters or stats.histograms:
            _FIGURES.by_worker[self.worker_id] = stats
            self.start_soon(self._figures, engine, name=f"{self.worker_id} figures")

    async def _figures(self, engine: ActorRef[Any]) -> None:
        """Poll an engine that keeps figures of its own (it publishes no metrics socket)."""
        while True:
            await anyio.sleep(FIGURES_INTERVAL_S)
            _FIGURES.by_worker[self.worker_id] = await engine.ask(control.GetStats())

    async def stopping(self, reason: Any) -> None:
        # Gone with its worker: a restarted engine counts from zero, under the same labels.
        _FIGURES.by_worker.pop(self.worker_id, None)

    async def _events(self, rank: int, endpoint: str, replay: str | None) -> None:
        subscriber = KvEventSubscriber(endpoint, replay, start_seq=0)
        self._subscribers.append(subscriber)
        async with subscriber:
            while True:
                for _seq, batch in await subscriber.receive():
                    self.batches += 1
                    KV_EVENTS.labels(self.worker_id, str(rank)).inc()
                    if self.sink is not None:
                        self.sink.kv_events(self.worker_id, rank, batch)

    async def _metrics(self, subscriber: KvMetricsSubscriber | SGLangMetricsReader) -> None:
        self._subscribers.append(subscriber)
        # Each rank's gauges, resolved once: labels() per message cost more than the updates.
        gauges: dict[int, tuple[Any, ...]] = {}
        async with subscriber:
            while True:
                metrics = await subscriber.receive()
                rank = metrics.data_parallel_rank or 0
                series = gauges.get(rank)
                if series is None:
                    labels = (self.worker_id, str(rank))
                    series = gauges[rank] = tuple(
                        g.labels(*labels) for g in (TOTAL_BLOCKS, CACHE_USAGE, ACTIVE, WAITING)
                    )
                total, usage, active, waiting = series
                total.set(metrics.kv_total_blocks)
                usage.set(metrics.gpu_cache_usage_perc)
                active.set(metrics.request_active_slots)
                waiting.set(metrics.num_requests_waiting)
                if self.sink is not None:
                    self.sink.load(self.worker_id, rank, metrics)

    async def receive(self, message: Any) -> Any:
        if message == "batches":
            return self.batches
        if message == "drop_sockets":
            # Fault injection (scenarios): the subscriptions drop under the reading tasks, which
            # fail, so this actor crashes and its restart subscribes afresh.
            for subscriber in self._subscribers:
                subscriber.drop()
            return None
        return await super().receive(message)
