"""The request streams' metrics (migrations, hand-overs, fallbacks, cancellations)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from actors.telemetry import REGISTRY

__all__ = [
    "CANCELLATIONS",
    "FALLBACKS",
    "LIVE_MIGRATIONS",
    "LIVE_MIGRATIONS_AHEAD",
    "MIGRATIONS",
    "MIGRATION_SECONDS",
]

MIGRATIONS = Counter(
    "actorserve_migration",
    "Requests re-dispatched to another worker.",
    ["model", "type"],
    registry=REGISTRY,
)
MIGRATION_SECONDS = Histogram(
    "actorserve_migration_duration_seconds",
    "From the failure to the first output of the new worker (or the terminal error).",
    ["model", "type", "outcome"],
    registry=REGISTRY,
)
FALLBACKS = Counter(
    "actorserve_decode_only_fallback",
    "Disaggregated requests served by a decode worker alone (no prefill worker routable).",
    ["model"],
    registry=REGISTRY,
)
LIVE_MIGRATIONS = Counter(
    "actorserve_live_migration",
    "Requests a draining decode worker handed over with their KV: continued on the new worker "
    "(success) or replayed from their tokens instead (fallback).",
    ["model", "outcome"],
    registry=REGISTRY,
)
LIVE_MIGRATIONS_AHEAD = Counter(
    "actorserve_live_migration_ahead",
    "Live migrations sent to the next worker as the drain began, while the draining worker's "
    "last step still ran: taken by the migration, or dropped (the request ended at that step, "
    "or went elsewhere).",
    ["model", "outcome"],
    registry=REGISTRY,
)
CANCELLATIONS = Counter(
    "actorserve_cancellation", "Requests cancelled by their client.", ["model"], registry=REGISTRY
)
