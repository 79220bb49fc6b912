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
        """Readiness: 200 while every served model can serve (a routable worker for each role
        its mode needs), else 503; each model's workers either way (``{"status": "ready" |
        "notready", "models": {name: {"status", "reason", "workers": {id: {"role",
        "state"}}}}, "uptime": s}``)."""
        try:
            models = dict(self.backend.health())
        except Exception as exc:
            log.error("backend health check failed", exc_info=exc)
            models = {}
        ready = bool(models) and all(m.ready for m in models.values())
        body = {
            "status": "ready" if ready else "notready",
            "models": {
                name: {
                    "status": "ready" if m.ready else "notready",
                    "reason": m.reason,
                    "workers": {
                        wid: {"role": w.role, "state": w.state} for wid, w in m.workers.items()
                    },
                }
                for name, m in models.items()
            },
            "uptime": self._uptime(),
        }
        return json_response(body, 200 if ready else 503)

    async def live(self) -> Response:
        """Liveness: 200 whenever the root's event loop answers, whatever its workers do (a
        failing liveness probe restarts the pod, which no worker's state should cause)."""
        return json_response({"status": "live", "uptime": self._uptime()})

    async def metrics(self) -> Response:
        """Prometheus text exposition of the frontend's (and the backend's) registry."""
        data = generate_latest(self.registry)
        extra = self.backend.metrics_registry()
        if extra is not None and extra is not self.registry:
            data += generate_latest(extra)
        return Response(data, media_type=CONTENT_TYPE_LATEST)
