"""The health-checker actor: canaries an idle worker and fails it after repeated failures.

When the worker has produced no output for ``idle_after`` seconds it sends the role's minimal
canary and judges the *whole* canary stream (a stream that starts and then stalls fails) within
``timeout``. After ``failures`` consecutive failures it raises, and the worker's one_for_all
supervisor restarts engine, publisher and checker together. It also tells the routing view
whether the worker may take requests.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import anyio
import attrs
from prometheus_client import Counter

from actors import Actor, ActorError, ActorRef, ExitReason, current_registry
from actors.serving.errors import HealthCheckFailed
from actors.telemetry import REGISTRY
from protocols import control
from protocols.engine import Capacity, EngineOutput
from protocols.errors import RequestError

__all__ = ["HealthCheckFailed", "HealthChecker", "HealthOptions", "WorkerDirectory"]

CANARIES = Counter(
    "actorserve_worker_canaries",
    "Canary requests by outcome.",
    ["worker", "outcome"],
    registry=REGISTRY,
)


@attrs.frozen
class HealthOptions:
    idle_after: float = 10.0  # Dynamo's DYN_CANARY_WAIT_TIME
    timeout: float = 3.0  # for the whole canary stream
    failures: int = 3  # consecutive, before the worker is failed
    interval: float = 1.0  # how often activity is checked


class WorkerDirectory(Protocol):
    """The routing view a checker keeps current for its worker."""

    def register(self, worker_id: str, engine: ActorRef[Any], capacity: Capacity) -> None: ...

    def set_healthy(self, worker_id: str, healthy: bool) -> None: ...

    def unregister(self, worker_id: str) -> None: ...


class HealthChecker(Actor):
    def __init__(
        self,
        worker_id: str,
        engine_name: str,
        options: HealthOptions | None = None,
        directory: WorkerDirectory | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.engine_name = engine_name
        self.options = options or HealthOptions()
        self.directory = directory
        self.consecutive_failures = 0
        self.canaries = 0

    async def started(self) -> None:
        engine = current_registry().whereis(self.engine_name)
        if engine is None:
            raise LookupError(f"no engine registered as {self.engine_name!r}")
        self.engine: ActorRef[Any] = engine
        capacity = await engine.ask(control.GetCapacity())
        if self.directory is not None:
            self.directory.register(self.worker_id, engine, capacity)
        self.start_soon(self._watch, name=f"{self.worker_id} health")

    async def stopping(self, reason: ExitReason) -> None:
        if self.directory is not None:
            self.directory.unregister(self.worker_id)

    async def _watch(self) -> None:
        opts = self.options
        while True:
            await anyio.sleep(opts.interval)
            state = await self._state()
            if state == "active":
                self._verdict(True)
            elif state == "idle":
                self._verdict(await self.canary())
            # "out of service": drained, paused or released by the lifecycle on purpose; a
            # canary could only fail there, and the routing view already keeps it out.

    async def _state(self) -> str:
        try:
            stats: control.EngineStats = await self.engine.ask(
                control.GetStats(), timeout=self.options.timeout
            )
        except (ActorError, TimeoutError):
            return "idle"  # no answer: let the canary judge it
        if not stats.admitting or stats.paused or stats.released:
            return "out of service"
        if stats.running > 0 or time.monotonic() - stats.last_output < self.options.idle_after:
            return "active"
        return "idle"

    def _verdict(self, healthy: bool) -> None:
        if self.directory is not None:
            self.directory.set_healthy(self.worker_id, healthy)
        if healthy:
            self.consecutive_failures = 0
            return
        self.consecutive_failures += 1
        if self.consecutive_failures >= self.options.failures:
            raise HealthCheckFailed(
                f"worker {self.worker_id!r} failed {self.consecutive_failures} canaries in a row"
            )

    async def canary(self) -> bool:
        """Send the canary and judge its whole stream within the timeout."""
        self.canaries += 1
        last: EngineOutput | None = None
        outcome = "timeout"
        with anyio.move_on_after(self.options.timeout):
            try:
                payload = await self.engine.ask(control.GetHealthPayload())
                async with self.engine.stream(payload) as outputs:
                    async for output in outputs:
                        last = output
                ok = last is not None and last.finish_reason in ("stop", "length")
                outcome = "ok" if ok else "bad_stream"
            except (ActorError, RequestError, TimeoutError):
                outcome = "error"
        CANARIES.labels(self.worker_id, outcome).inc()
        return outcome == "ok"

    async def receive(self, message: Any) -> Any:
        if message == "canary":
            return await self.canary()
        if message == "failures":
            return self.consecutive_failures
        return await super().receive(message)
