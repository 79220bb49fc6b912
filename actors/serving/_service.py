"""The frontend's backend: one :class:`ModelService` per served model."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

from prometheus_client import CollectorRegistry

from actors.frontend import Backend, EndpointStatus, ModelInfo
from actors.serving._admission import Admission
from actors.serving._routing import RoutingTable
from protocols.engine import EngineOutput, PreprocessedRequest
from protocols.errors import ModelNotFound, NoWorkerAvailable
from supervisors import SupervisorRef

__all__ = ["ModelService"]


class ModelService(Backend):
    """Starts a request-stream actor per request and streams its outputs to the frontend.

    Closing the stream (the client went away) cancels the request-stream actor's handler, which
    closes the engine stream: the engine aborts the request and frees its KV.
    """

    def __init__(
        self,
        model: ModelInfo,
        streams: SupervisorRef,
        table: RoutingTable,
        admission: Admission | None = None,
    ) -> None:
        self.model = model
        self.streams = streams
        self.table = table
        self.admission = admission or Admission()

    def models(self) -> list[ModelInfo]:
        return [self.model]

    async def generate(
        self, model: str, request: PreprocessedRequest
    ) -> AsyncIterator[EngineOutput]:
        if model != self.model.name:
            raise ModelNotFound(f"model {model!r} is not served (try {self.model.name!r})")
        if not any(w.routable for w in self.table.workers.values()):
            raise NoWorkerAvailable("no worker is ready yet")
        self.admission.enter()
        try:
            stream = await self.streams.start_dynamic()
            if stream is None:
                raise NoWorkerAvailable("the request could not be started")
            async with stream.stream(request) as outputs:
                async for output in outputs:
                    yield output
        finally:
            self.admission.leave()

    def health(self) -> Mapping[str, EndpointStatus]:
        ready = self.admission.ready and any(w.routable for w in self.table.workers.values())
        return {"generate": "ready" if ready else "notready"}

    def metrics_registry(self) -> CollectorRegistry | None:
        return None
