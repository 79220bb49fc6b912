"""A serving worker: the engine actor (in its own process), its publisher and health checker,
under one one_for_all supervisor."""

from actors.worker._health import HealthChecker, HealthCheckFailed, HealthOptions, WorkerDirectory
from actors.worker._host import EngineHost, build_engine
from actors.worker._publisher import Publisher, WorkerSink
from actors.worker._spec import engine_name, worker_spec

__all__ = [
    "EngineHost",
    "HealthCheckFailed",
    "HealthChecker",
    "HealthOptions",
    "Publisher",
    "WorkerDirectory",
    "WorkerSink",
    "build_engine",
    "engine_name",
    "worker_spec",
]
