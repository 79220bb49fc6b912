"""Routing: the shared view of every worker (roles, load, KV prefix index) and its policies.

:class:`RoutingTable` holds one :class:`WorkerEntry` per worker and picks a worker for a request
(round-robin, least-loaded or KV-aware); :class:`Router` is the actor that serves the same
choices to callers outside the request streams.
"""

from actors.serving.routing._router import Done, Route, Routed, Router
from actors.serving.routing._table import Policy, Role, RoutingTable, WorkerEntry

__all__ = ["Done", "Policy", "Role", "Route", "Routed", "Router", "RoutingTable", "WorkerEntry"]
