"""The stages of the root's ordered operations (drain, release, resume, scale, shutdown): each
timed, logged and counted by outcome; and how to wait for an engine to be quiescent."""

from __future__ import annotations

from typing import Any

import anyio
import structlog
from prometheus_client import Counter, Histogram

from actors import ActorRef
from actors.telemetry import REGISTRY
from protocols import control

__all__ = ["Stage", "wait_quiescent"]

_log = structlog.get_logger("actorserve.lifecycle")
STAGES = Counter(
    "actorserve_lifecycle_stages",
    "Lifecycle stages by outcome.",
    ["operation", "stage", "outcome"],
    registry=REGISTRY,
)
STAGE_SECONDS = Histogram(
    "actorserve_lifecycle_stage_duration_seconds",
    "How long each stage took.",
    ["operation", "stage"],
    # From a memory release on an idle worker to a drain that runs out its whole budget.
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
    registry=REGISTRY,
)


async def wait_quiescent(engine: ActorRef[Any]) -> None:
    """Return once the engine actor's engine is quiescent (see ``control.WaitQuiescent``)."""
    async with engine.stream(control.WaitQuiescent(), buffer=1) as replies:
        async for _ in replies:
            pass


class Stage:
    """Times and logs one stage; an exception marks it failed."""

    def __init__(self, operation: str, stage: str, **fields: Any) -> None:
        self.operation, self.stage, self.fields = operation, stage, fields

    def __enter__(self) -> Stage:
        self.start = anyio.current_time()
        _log.info(
            "stage", operation=self.operation, stage=self.stage, status="started", **self.fields
        )
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        took = anyio.current_time() - self.start
        outcome = "completed" if exc_type is None else "failed"
        STAGES.labels(self.operation, self.stage, outcome).inc()
        STAGE_SECONDS.labels(self.operation, self.stage).observe(took)
        _log.info(
            "stage",
            operation=self.operation,
            stage=self.stage,
            status=outcome,
            seconds=round(took, 4),
            **self.fields,
        )
