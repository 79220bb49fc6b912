"""The root's control API: drain / undrain a worker, release / resume memory (a worker or a
pool, with tags), scale a pool, shutdown. HTTP on loopback, every call carrying a bearer token."""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from actors import Actor, ActorRef
from actors.serving.root._lifecycle import (
    DrainWorker,
    LifecycleError,
    Release,
    Resume,
    UndrainWorker,
    WorkerStates,
)
from actors.serving.root._scale import ScaleDown, ScaleTo, ScaleUp
from protocols.engine import MemoryTag

__all__ = ["ControlApi", "control_app", "load_token"]

TOKEN_ENV = "ACTORSERVE_CONTROL_TOKEN"


def load_token(path: str | None) -> str | None:
    """The operator's token: from ``path``, else ``$ACTORSERVE_CONTROL_TOKEN``; ``None`` lets the
    root make a fresh one in its private run directory."""
    if path:
        token = Path(path).read_text().strip()
        if not token:
            raise ValueError(f"{path} holds no token")
        return token
    return os.environ.get(TOKEN_ENV) or None


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


def _count(value: Any, name: str) -> int:
    """A body's whole number (JSON's true is no number here)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    return value


def control_app(lifecycle: ActorRef[Any], token: str, shutdown: Callable[[], None]) -> Starlette:
    """The ASGI app; ``shutdown`` starts the root's graceful shutdown."""

    def guarded(
        handler: Callable[[dict[str, Any]], Awaitable[Any]],
    ) -> Callable[[Request], Awaitable[JSONResponse]]:
        async def endpoint(request: Request) -> JSONResponse:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not given:  # the scheme is case-insensitive
                return _error(401, "missing bearer token")
            if not hmac.compare_digest(given.strip().encode(), token.encode()):
                return _error(403, "wrong token")
            body: Any = {}
            if request.method == "POST" and await request.body():
                try:
                    body = await request.json()
                except ValueError:
                    return _error(400, "the body is not JSON")
            if not isinstance(body, dict):
                return _error(400, "the body must be a JSON object")
            try:
                result = await handler(body)
            except (LifecycleError, ValueError, KeyError, TypeError) as exc:
                return _error(409 if isinstance(exc, LifecycleError) else 400, str(exc))
            return JSONResponse(
                {"status": "ok", **({"result": result} if result is not None else {})}
            )

        return endpoint

    def tags(body: dict[str, Any]) -> tuple[MemoryTag, ...]:
        return tuple(MemoryTag(t) for t in body.get("tags") or ())

    async def workers(body: dict[str, Any]) -> Any:
        return await lifecycle.ask(WorkerStates())

    async def drain(body: dict[str, Any]) -> None:
        await lifecycle.ask(
            DrainWorker(
                str(body["worker"]),
                bool(body.get("handover", True)),
                bool(body.get("live", True)),
            ),
            timeout=None,
        )

    async def undrain(body: dict[str, Any]) -> None:
        await lifecycle.ask(UndrainWorker(str(body["worker"])), timeout=None)

    async def release(body: dict[str, Any]) -> None:
        message = Release(
            body.get("worker"), body.get("pool"), tags(body), bool(body.get("rolling", False))
        )
        await lifecycle.ask(message, timeout=None)

    async def resume(body: dict[str, Any]) -> None:
        await lifecycle.ask(Resume(body.get("worker"), body.get("pool"), tags(body)), timeout=None)

    async def scale(body: dict[str, Any]) -> Any:
        pool, worker, model = str(body["pool"]), body.get("worker"), body.get("model")
        if ("delta" in body) == ("to" in body):
            raise ValueError("give one of delta (workers to add, or to remove if < 0) or to")
        message: ScaleUp | ScaleDown | ScaleTo
        if "to" in body:
            message = ScaleTo(pool, _count(body["to"], "to"), model)
        elif (delta := _count(body["delta"], "delta")) > 0:
            if worker is not None:
                raise ValueError("worker names a worker to remove: give it with a delta of -1")
            message = ScaleUp(pool, delta, model)
        elif delta < 0:
            message = ScaleDown(pool, None if worker is None else str(worker), -delta, model)
        else:
            raise ValueError("a delta of 0 changes nothing")
        return await lifecycle.ask(message, timeout=None)

    async def stop(body: dict[str, Any]) -> None:
        shutdown()

    routes = [
        Route("/control/workers", guarded(workers), methods=["GET"]),
        Route("/control/drain", guarded(drain), methods=["POST"]),
        Route("/control/undrain", guarded(undrain), methods=["POST"]),
        Route("/control/release", guarded(release), methods=["POST"]),
        Route("/control/resume", guarded(resume), methods=["POST"]),
        Route("/control/scale", guarded(scale), methods=["POST"]),
        Route("/control/shutdown", guarded(stop), methods=["POST"]),
    ]

    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        return _error(404, f"no control endpoint {request.method} {request.url.path}")

    async def not_allowed(request: Request, exc: Exception) -> JSONResponse:
        return _error(405, f"{request.method} is not allowed on {request.url.path}")

    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed})


class ControlApi(Actor):
    """Serves :func:`control_app` on ``host:port`` (loopback by default)."""

    def __init__(
        self, lifecycle_name: str, token: str, shutdown: Callable[[], None], host: str, port: int
    ) -> None:
        self.lifecycle_name = lifecycle_name
        self.token = token
        self.shutdown = shutdown
        self.host = host
        self.port = port
        self.bound: int | None = None

    async def started(self) -> None:
        from actors import current_registry
        from actors.serving.frontend import serve

        lifecycle = current_registry().whereis(self.lifecycle_name)
        if lifecycle is None:
            raise LookupError(f"no {self.lifecycle_name!r} actor")
        app = control_app(lifecycle, self.token, self.shutdown)
        self.bound = await self.task_group.start(serve, app, self.host, self.port)

    async def receive(self, message: Any) -> Any:
        if message == "port":
            return self.bound
        return await super().receive(message)
