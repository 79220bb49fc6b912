"""A serving worker: the engine actor (in its own process), its publisher and health checker,
under one one_for_all supervisor; the engine is one of :data:`BACKENDS`, the table of backends
by name."""

from actors.serving.worker._backends import (
    BACKENDS,
    BackendName,
    EngineBackend,
    EngineSetup,
    UnknownBackend,
    engine_backend,
)
from actors.serving.worker._health import (
    HealthChecker,
    HealthCheckFailed,
    HealthOptions,
    WorkerDirectory,
)
from actors.serving.worker._host import EngineHost
from actors.serving.worker._publisher import Publisher, WorkerSink
from actors.serving.worker._spec import engine_name, worker_spec
from actors.serving.worker._subscribe import (
    KvEventSubscriber,
    KvEventSubscriberStatistics,
    KvMetricsSubscriber,
    replay_kv_events,
)

__all__ = [
    "BACKENDS",
    "BackendName",
    "EngineBackend",
    "EngineHost",
    "EngineSetup",
    "HealthCheckFailed",
    "HealthChecker",
    "HealthOptions",
    "KvEventSubscriber",
    "KvEventSubscriberStatistics",
    "KvMetricsSubscriber",
    "Publisher",
    "UnknownBackend",
    "WorkerDirectory",
    "WorkerSink",
    "engine_backend",
    "engine_name",
    "replay_kv_events",
    "worker_spec",
]
