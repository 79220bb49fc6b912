"""The frontend's backend: every served model's requests, each to its own request streams."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence

import attrs
from prometheus_client import CollectorRegistry

from actors.serving.frontend import Backend, ModelHealth, ModelInfo, WorkerHealth
from actors.serving.requests import Admission, open_request
from actors.serving.routing import RoutingTable
from protocols.engine import EngineOutput, PreprocessedRequest
from protocols.errors import ModelNotFound
from supervisors import SupervisorRef

__all__ = ["ModelService", "ServedModel"]


@attrs.frozen
class ServedModel:
    """One model as the service routes to it: its description, its request-stream supervisor
    and its routing table."""

    info: ModelInfo
    streams: SupervisorRef
    table: RoutingTable
    request_timeout: float = 600.0


class ModelService(Backend):
    """Serves the models' requests to the frontend: each one is opened by
    :func:`~actors.serving.requests.open_request` (admission, then a request-stream actor of its
    model that owns it), and the frontend reads its outputs in its own task."""

    def __init__(self, models: Sequence[ServedModel], admission: Admission | None = None) -> None:
        self.served = {m.info.name: m for m in models}
        self.admission = admission or Admission()

    def models(self) -> list[ModelInfo]:
        return [m.info for m in self.served.values()]

    def generate(self, model: str, request: PreprocessedRequest) -> AsyncIterator[EngineOutput]:
        served = self.served.get(model)
        if served is None:
            known = ", ".join(repr(name) for name in self.served)
            raise ModelNotFound(f"model {model!r} is not served (try {known})")
        return open_request(
            served.streams, served.table, self.admission, request, timeout=served.request_timeout
        )

    def health(self) -> Mapping[str, ModelHealth]:
        return {name: self._health(m.table) for name, m in self.served.items()}

    def _health(self, table: RoutingTable) -> ModelHealth:
        states = table.states()
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
        return ModelHealth(reason is None, reason, workers)

    def metrics_registry(self) -> CollectorRegistry | None:
        return None
