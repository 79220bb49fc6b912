"""The frontend's backend: one :class:`ModelService` per served model."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

from prometheus_client import CollectorRegistry

from actors.serving.frontend import Backend, ModelHealth, ModelInfo, WorkerHealth
from actors.serving.requests import Admission, open_request
from actors.serving.routing import RoutingTable
from protocols.engine import EngineOutput, PreprocessedRequest
from protocols.errors import ModelNotFound
from supervisors import SupervisorRef

__all__ = ["ModelService"]


class ModelService(Backend):
    """Serves the model's requests to the frontend: each one is opened by
    :func:`~actors.serving.requests.open_request` (admission, then a request-stream actor that
    owns it), and the frontend reads its outputs in its own task."""

    def __init__(
        self,
        model: ModelInfo,
        streams: SupervisorRef,
        table: RoutingTable,
        admission: Admission | None = None,
        *,
        request_timeout: float,
    ) -> None:
        self.model = model
        self.streams = streams
        self.table = table
        self.admission = admission or Admission()
        self.request_timeout = request_timeout

    def models(self) -> list[ModelInfo]:
        return [self.model]

    def generate(self, model: str, request: PreprocessedRequest) -> AsyncIterator[EngineOutput]:
        if model != self.model.name:
            raise ModelNotFound(f"model {model!r} is not served (try {self.model.name!r})")
        return open_request(
            self.streams, self.table, self.admission, request, timeout=self.request_timeout
        )

    def health(self) -> Mapping[str, ModelHealth]:
        states = self.table.states()
        workers = {wid: WorkerHealth(role, state) for wid, (role, state) in states.items()}
        # Ready while each role the mode needs has a routable worker: one restarting decode
        # worker among several must not take the whole root out of a load balancer.
        missing = sorted(
            {r for r, _ in states.values()} - {r for r, s in states.values() if s == "ready"}
        )
        reason: str | None = None
        if not self.admission.ready:
            reason = "shutting down"
        elif missing:
            reason = "no routable " + " or ".join(missing) + " worker"
        return {self.model.name: ModelHealth(reason is None, reason, workers)}

    def metrics_registry(self) -> CollectorRegistry | None:
        return None
