"""Routing: the shared view of every worker (roles, load, KV prefix index) and its policies.

:class:`RoutingTable` holds one :class:`WorkerEntry` per worker, with one :class:`RankEntry` per
data-parallel rank of its engine (each rank has its own load and KV cache), and picks a worker
and a rank for a request (round-robin, least-loaded or KV-aware) for the request streams, which
route with it directly on the root's event loop; :class:`Routed` is where one attempt of a
request went.
"""

from actors.serving.routing._table import (
    Policy,
    RankEntry,
    Role,
    Routed,
    RoutingTable,
    WorkerEntry,
)

__all__ = ["Policy", "RankEntry", "Role", "Routed", "RoutingTable", "WorkerEntry"]
