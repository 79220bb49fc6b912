"""Routing: the shared view of every worker (roles, load, KV prefix index) and its policies.

:class:`RoutingTable` holds one :class:`WorkerEntry` per worker and picks a worker for a request
(round-robin, least-loaded or KV-aware) for the request streams, which route with it directly on
the root's event loop; :class:`Routed` is where one attempt of a request went.
"""

from actors.serving.routing._table import Policy, Role, Routed, RoutingTable, WorkerEntry

__all__ = ["Policy", "Role", "Routed", "RoutingTable", "WorkerEntry"]
