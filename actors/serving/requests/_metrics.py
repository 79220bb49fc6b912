"""The request streams' metrics (migrations, hand-overs, fallbacks, prefill decisions,
cancellations, prefix-cache hits), named as Dynamo's frontend names them
(``dynamo_frontend_model_migration_total``, ...): the request streams run in the root, behind its
HTTP frontend."""

from __future__ import annotations

from typing import Literal, get_args

from prometheus_client import Counter, Histogram

from actors.telemetry import REGISTRY

__all__ = [
    "CACHED_TOKENS",
    "CANCELLATIONS",
    "FALLBACKS",
    "LIVE_MIGRATIONS",
    "LIVE_MIGRATIONS_AHEAD",
    "MIGRATIONS",
    "MIGRATION_SECONDS",
    "PREFILL_DECISIONS",
    "PROMPT_TOKENS",
    "LocalReason",
    "RemoteReason",
    "declare_model",
]

# Why a disaggregated attempt was prefilled on its decode worker, or on a prefill worker.
LocalReason = Literal["short_prompt", "prefill_queue", "no_prefill_worker"]
RemoteReason = Literal["long_prompt", "off", "decode_cannot_prefill"]

MIGRATIONS = Counter(
    "actorserve_frontend_model_migration",
    "Requests re-dispatched to another worker.",
    ["model", "migration_type"],
    registry=REGISTRY,
)
MIGRATION_SECONDS = Histogram(
    "actorserve_frontend_model_migration_duration_seconds",
    "From the failure to the first output of the new worker (or the terminal error).",
    ["model", "migration_type", "outcome"],
    registry=REGISTRY,
)
FALLBACKS = Counter(
    "actorserve_frontend_decode_only_fallback",
    "Disaggregated requests served by a decode worker alone (no prefill worker routable).",
    ["model"],
    registry=REGISTRY,
)
PREFILL_DECISIONS = Counter(
    "actorserve_frontend_prefill_decision",
    "Disaggregated attempts by where their prompt was prefilled: on their decode worker "
    "(local) or on a prefill worker (remote), and why.",
    ["model", "decision", "reason"],
    registry=REGISTRY,
)
LIVE_MIGRATIONS = Counter(
    "actorserve_frontend_model_live_migration",
    "Requests a draining decode worker handed over with their KV: continued on the new worker "
    "(success) or replayed from their tokens instead (fallback).",
    ["model", "outcome"],
    registry=REGISTRY,
)
LIVE_MIGRATIONS_AHEAD = Counter(
    "actorserve_frontend_model_live_migration_ahead",
    "Live migrations sent to the next worker as the drain began, while the draining worker's "
    "last step still ran: taken by the migration, or dropped (the request ended at that step, "
    "or went elsewhere).",
    ["model", "outcome"],
    registry=REGISTRY,
)
CANCELLATIONS = Counter(
    "actorserve_frontend_model_cancellation",
    "Requests cancelled by their client (or the server's shutdown) before they finished.",
    ["model"],
    registry=REGISTRY,
)
PROMPT_TOKENS = Counter(
    "actorserve_worker_prompt_tokens",
    "Prompt tokens of the requests a worker finished, as its engine counted them.",
    ["worker"],
    registry=REGISTRY,
)
CACHED_TOKENS = Counter(
    "actorserve_worker_cached_tokens",
    "Of those prompt tokens, the ones served from the worker's prefix cache (the hit ratio is "
    "rate(cached) / rate(prompt)).",
    ["worker"],
    registry=REGISTRY,
)


def declare_model(model: str) -> None:
    """Export the model's counters at 0 before their first event, so that ``rate()`` and
    ``increase()`` see that first event (a series that appears at 1 shows no increase)."""
    for migration_type in ("new_request", "ongoing_request"):
        MIGRATIONS.labels(model, migration_type)
    CANCELLATIONS.labels(model)
    FALLBACKS.labels(model)
    for reason in get_args(LocalReason):
        PREFILL_DECISIONS.labels(model, "local", reason)
    for reason in get_args(RemoteReason):
        PREFILL_DECISIONS.labels(model, "remote", reason)
    for outcome in ("success", "fallback"):
        LIVE_MIGRATIONS.labels(model, outcome)
    for outcome in ("taken", "dropped"):
        LIVE_MIGRATIONS_AHEAD.labels(model, outcome)
