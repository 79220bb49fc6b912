"""One worker: a one_for_all supervisor of engine, publisher and health checker."""

from __future__ import annotations

from actors.process import ProcessOptions
from actors.serving.worker._backends import BackendName
from actors.serving.worker._health import HealthChecker, HealthOptions, WorkerDirectory
from actors.serving.worker._publisher import Publisher, WorkerSink
from supervisors import (
    Backoff,
    ChildSpec,
    Quarantine,
    Strategy,
    Supervisor,
    SupervisorFlags,
    process_child,
)

__all__ = ["engine_name", "worker_spec"]


def engine_name(worker_id: str) -> str:
    """The registered name of a worker's engine actor."""
    return f"{worker_id}/engine"


def worker_spec(
    worker_id: str,
    backend: BackendName,
    config: bytes,
    *,
    process: ProcessOptions | None = None,
    health: HealthOptions | None = None,
    directory: WorkerDirectory | None = None,
    sink: WorkerSink | None = None,
    backoff: Backoff | None = None,
    intensity: int = 3,
    period: float = 60.0,
    quarantine: Quarantine | None = None,
) -> ChildSpec:
    """The child spec of worker ``worker_id`` (engine ``backend`` of the backend table, built
    from ``config``, what that backend's ``configure`` made).

    The engine runs in its own process. Engines that die at load back off before restarting
    (a GPU engine must not hot-loop), and the worker gives up after ``intensity`` restarts in
    ``period`` seconds, escalating to its pool; with ``quarantine``, a worker that keeps
    escalating is left down for a while instead, its pool and its siblings untouched.
    """
    name = engine_name(worker_id)
    children = [
        process_child(
            "engine",
            "actors.serving.worker._host:EngineHost",
            backend,
            config,
            worker_id,
            options=process,
            name=name,
            backoff=backoff or Backoff(0.1, 10.0),
            shutdown=30.0,
        ),
        ChildSpec("publisher", lambda: Publisher(worker_id, name, sink)),
        ChildSpec("health", lambda: HealthChecker(worker_id, name, health, directory)),
    ]

    def start() -> Supervisor:
        return Supervisor(
            children, SupervisorFlags(Strategy.ONE_FOR_ALL, intensity, period), name=worker_id
        )

    return ChildSpec(worker_id, start, kind="supervisor", quarantine=quarantine)
