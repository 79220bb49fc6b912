"""The router actor: picks the worker for each request (and tracks what it routed)."""

from __future__ import annotations

from typing import Any

import attrs

from actors import Actor, ActorRef, Call
from actors.serving.routing._table import Policy, Role, RoutingTable
from protocols.engine import BootstrapInfo, PreprocessedRequest
from protocols.errors import RequestError

__all__ = ["Done", "Route", "Routed", "Router"]


@attrs.frozen
class Done(Call[None]):
    worker_id: str


@attrs.frozen
class Routed:
    worker_id: str
    engine: ActorRef[Any]
    bootstrap: BootstrapInfo | None = None  # a prefill worker's KV bootstrap endpoint

    def done(self) -> Done:
        return Done(self.worker_id)


@attrs.frozen
class Route(Call[Routed]):
    request: PreprocessedRequest
    exclude: tuple[str, ...] = ()
    role: Role = "aggregated"


class Router(Actor):
    """Answers :class:`Route` with a routable worker by ``policy``: ``round_robin``,
    ``least_loaded`` (load metrics plus its own in-flight count) or ``kv_aware`` (prefix overlap
    from the workers' KV events, then load). Request streams route the same way without asking
    it (``RoutingTable.take`` and ``done``, on the same table): both count the same in-flight
    requests."""

    reply_errors = (RequestError,)

    def __init__(self, table: RoutingTable, policy: Policy = "kv_aware") -> None:
        self.table = table
        self.policy = policy
        self.routed = 0

    async def receive(self, message: Any) -> Any:
        match message:
            case Route(request=request, exclude=exclude, role=role):
                entry = self.table.take(role, self.policy, request.token_ids, exclude)
                self.routed += 1
                return Routed(entry.id, entry.engine, entry.capacity.bootstrap)
            case Done(worker_id=worker_id):
                self.table.done(worker_id)
                return None
            case _:
                return await super().receive(message)
