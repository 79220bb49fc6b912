"""The non-generation routes: ``/v1/models``, ``/health``, ``/live``, ``/metrics``."""

from __future__ import annotations

import json
import logging
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.responses import Response

from protocols.errors import ModelNotFound

from ._backend import Backend, ModelInfo
from ._errors import error_response

__all__ = ["Ops", "json_response"]

log = logging.getLogger("actorserve.frontend")


def json_response(obj: object, status: int = 200) -> Response:
    """A small JSON response (not on the hot path)."""
    return Response(json.dumps(obj).encode(), status_code=status, media_type="application/json")


class Ops:
    """Route handlers for the served models, readiness, liveness and metrics."""

    def __init__(self, backend: Backend, registry: CollectorRegistry) -> None:
        self.backend = backend
        self.registry = registry
        self.started = time.monotonic()

    def _uptime(self) -> float:
        return round(time.monotonic() - self.started, 3)

    @staticmethod
    def _card(info: ModelInfo) -> dict[str, object]:
        return {
            "id": info.name,
            "object": "model",
            "created": info.created,
            "owned_by": info.owned_by,
            "max_model_len": info.context_length,
        }

    async def list_models(self) -> Response:
        """The served models (OpenAI ``GET /v1/models``)."""
        cards = [self._card(i) for i in self.backend.models()]
        return json_response({"object": "list", "data": cards})

    async def get_model(self, model_id: str) -> Response:
        """One served model (OpenAI ``GET /v1/models/{model}``)."""
        for info in self.backend.models():
            if info.name == model_id:
                return json_response(self._card(info))
        return error_response(ModelNotFound(f"The model `{model_id}` does not exist."))

    async def health(self) -> Response:
        """200 when every backend endpoint is ready, else 503; the per-endpoint view either way
        (Dynamo's shape: ``{"status": "ready"|"notready", "endpoints": {...}, "uptime": s}``)."""
        try:
            endpoints = {str(k): str(v) for k, v in self.backend.health().items()}
        except Exception as exc:
            log.error("backend health check failed", exc_info=exc)
            endpoints = {}
        ready = bool(endpoints) and all(v == "ready" for v in endpoints.values())
        body = {
            "status": "ready" if ready else "notready",
            "endpoints": endpoints,
            "uptime": self._uptime(),
        }
        return json_response(body, 200 if ready else 503)

    async def live(self) -> Response:
        """Always 200 while the process serves HTTP."""
        return json_response({"status": "live", "uptime": self._uptime()})

    async def metrics(self) -> Response:
        """Prometheus text exposition of the frontend's (and the backend's) registry."""
        data = generate_latest(self.registry)
        extra = self.backend.metrics_registry()
        if extra is not None and extra is not self.registry:
            data += generate_latest(extra)
        return Response(data, media_type=CONTENT_TYPE_LATEST)
