"""A serving worker: the engine actor (in its own process), its publisher and health checker,
under one one_for_all supervisor."""

from actors.serving.worker._health import (
    HealthChecker,
    HealthCheckFailed,
    HealthOptions,
    WorkerDirectory,
)
from actors.serving.worker._host import EngineHost, build_engine
from actors.serving.worker._publisher import Publisher, WorkerSink
from actors.serving.worker._spec import engine_name, worker_spec
from actors.serving.worker._subscribe import (
    KvEventSubscriber,
    KvEventSubscriberStatistics,
    KvMetricsSubscriber,
    replay_kv_events,
)

__all__ = [
    "EngineHost",
    "HealthCheckFailed",
    "HealthChecker",
    "HealthOptions",
    "KvEventSubscriber",
    "KvEventSubscriberStatistics",
    "KvMetricsSubscriber",
    "Publisher",
    "WorkerDirectory",
    "WorkerSink",
    "build_engine",
    "engine_name",
    "replay_kv_events",
    "worker_spec",
]
