"""The frontend's backend: one :class:`ModelService` per served model."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

from prometheus_client import CollectorRegistry

from actors.serving.frontend import Backend, EndpointStatus, ModelInfo
from actors.serving.requests import Admission, Attempt, Begin, RequestOutputs
from actors.serving.routing import RoutingTable
from protocols.engine import EngineOutput, PreprocessedRequest
from protocols.errors import ModelNotFound, NoWorkerAvailable
from supervisors import SupervisorRef

__all__ = ["ModelService"]


class ModelService(Backend):
    """Starts a request-stream actor per request; the frontend reads the request's outputs in
    its own task (see :class:`~actors.serving.RequestOutputs`).

    Closing the outputs early (the client went away) closes the engine stream, so the engine
    aborts the request and frees its KV, and tells the request-stream actor.
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

    def generate(self, model: str, request: PreprocessedRequest) -> AsyncIterator[EngineOutput]:
        if model != self.model.name:
            raise ModelNotFound(f"model {model!r} is not served (try {self.model.name!r})")
        if not any(w.routable for w in self.table.workers.values()):
            raise NoWorkerAvailable("no worker is ready yet")
        self.admission.enter()
        return _Outputs(self, request)

    def health(self) -> Mapping[str, EndpointStatus]:
        ready = self.admission.ready and any(w.routable for w in self.table.workers.values())
        return {"generate": "ready" if ready else "notready"}

    def metrics_registry(self) -> CollectorRegistry | None:
        return None


class _Outputs(RequestOutputs):
    """One request's outputs, served by a request-stream actor started with the request on
    the first ``__anext__``; closing it (always done, see :class:`~actors.serving.frontend.Backend`)
    ends the request and counts it out of admission."""

    __slots__ = ("_service",)

    def __init__(self, service: ModelService, request: PreprocessedRequest) -> None:
        super().__init__(None, request)
        self._service = service

    async def begin(self, message: Begin) -> Attempt:
        # The actor starts with the request in its mailbox: it routes and sends it to the
        # engine as soon as it runs, before its start is even confirmed to us.
        started = await self._service.streams.start_dynamic_ask(message)
        if started is None:
            raise NoWorkerAvailable("the request could not be started")
        return started[1]

    def close(self) -> None:
        if not self.closed:
            super().close()
            self._service.admission.leave()
