"""Counting what happened server-side, from the frontend's ``/metrics``.

The registry is process-wide and lives across runs, so a run's counts are the difference of
two scrapes (before and after the faulted load).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import httpx
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["COUNTERS", "Sample", "counters", "gauge", "scrape"]

Labels = frozenset[tuple[str, str]]
Sample = dict[tuple[str, Labels], float]


async def scrape(client: httpx.AsyncClient) -> Sample:
    """Every ``*_total`` sample of ``/metrics``, by (name, labels)."""
    response = await client.get("/metrics", timeout=10)
    response.raise_for_status()
    out: Sample = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name.endswith("_total"):
                out[(sample.name, frozenset(sample.labels.items()))] = float(sample.value)
    return out


async def gauge(client: httpx.AsyncClient, name: str) -> float:
    """The sum of a gauge's samples (every label set) on ``/metrics``."""
    response = await client.get("/metrics", timeout=10)
    response.raise_for_status()
    return sum(
        float(sample.value)
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.name == name
    )


def _sum(
    name: str, keep: Callable[[dict[str, str]], bool] = lambda _: True
) -> Callable[[Sample], float]:
    def total(sample: Sample) -> float:
        return sum(v for (n, labels), v in sample.items() if n == name and keep(dict(labels)))

    return total


def _events(
    event: str, keep: Callable[[dict[str, str]], bool] = lambda _: True
) -> Callable[[Sample], float]:
    return _sum(
        "actorserve_supervisor_events_total",
        lambda labels: labels.get("event") == event and keep(labels),
    )


def _stage(stage: str, outcome: str) -> Callable[[dict[str, str]], bool]:
    return lambda labels: labels.get("stage") == stage and labels.get("outcome") == outcome


_MIGRATIONS = "actorserve_frontend_model_migration_total"

# Server-side counters a scenario can bound (``Expect.counters``); the report adds client-side
# ones: ``requests_failed``, ``rejections`` (503s seen), ``cancelled`` (client disconnects).
COUNTERS: Mapping[str, Callable[[Sample], float]] = {
    "migrations": _sum(_MIGRATIONS),
    "migrations_ongoing": _sum(
        _MIGRATIONS, lambda labels: labels.get("migration_type") == "ongoing_request"
    ),
    "migrations_new": _sum(
        _MIGRATIONS, lambda labels: labels.get("migration_type") == "new_request"
    ),
    "cancellations": _sum("actorserve_frontend_model_cancellation_total"),
    # A worker's engine restarted (with its publisher and health checker: one_for_all).
    "engine_restarts": _events("restarted", lambda labels: labels.get("child") == "engine"),
    # A whole worker restarted by its pool (after the worker escalated).
    "worker_restarts": _events(
        "restarted", lambda labels: labels.get("supervisor", "").endswith("-pool")
    ),
    "escalations": _events("escalated"),
    "backoffs": _events("backoff"),
    "start_failures": _events("start_failed"),
    # Lifecycle stages (actors.serving.root._lifecycle) that completed, or failed.
    "releases": _sum("actorserve_lifecycle_stages_total", _stage("release_memory", "completed")),
    "resumes": _sum("actorserve_lifecycle_stages_total", _stage("resume_memory", "completed")),
    "drains": _sum("actorserve_lifecycle_stages_total", _stage("stop_admission", "completed")),
    "lifecycle_failures": _sum(
        "actorserve_lifecycle_stages_total", lambda labels: labels.get("outcome") == "failed"
    ),
    "canary_failures": _sum(
        "actorserve_worker_canaries_total", lambda labels: labels.get("outcome") != "ok"
    ),
}


def counters(before: Sample, after: Sample) -> dict[str, float]:
    """Each of :data:`COUNTERS` over the run (``after - before``)."""
    return {name: count(after) - count(before) for name, count in COUNTERS.items()}
