"""The frontend's backend: one :class:`ModelService` per served model."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

from anyio import WouldBlock
from prometheus_client import CollectorRegistry

from actors import ReplyStream
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


class _Outputs:
    """One request's outputs: the replies of its request-stream actor, started on the first
    ``__anext__``. ``next_nowait`` hands out replies already here (the frontend writes them
    together); ``aclose`` (always called, see :class:`~actors.frontend.Backend`) closes the
    reply stream, which cancels the actor's handler if it still runs, and counts the request
    out of admission."""

    __slots__ = ("_closed", "_request", "_service", "_stream")

    def __init__(self, service: ModelService, request: PreprocessedRequest) -> None:
        self._service = service
        self._request = request
        self._stream: ReplyStream[EngineOutput] | None = None
        self._closed = False

    def __aiter__(self) -> _Outputs:
        return self

    async def __anext__(self) -> EngineOutput:
        stream = self._stream
        if stream is None:
            stream = self._stream = await self._open()
        return await stream.__anext__()

    async def _open(self) -> ReplyStream[EngineOutput]:
        if self._closed:
            raise StopAsyncIteration
        ref = await self._service.streams.start_dynamic()
        if ref is None:
            raise NoWorkerAvailable("the request could not be started")
        stream: ReplyStream[EngineOutput] = ref.stream(self._request)
        return stream

    def next_nowait(self) -> EngineOutput | None:
        """An output that is already here, or ``None``."""
        if self._stream is None:
            return None
        try:
            return self._stream.receive_nowait()
        except WouldBlock:
            return None

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._stream is not None:
            self._stream.close()
        self._service.admission.leave()
