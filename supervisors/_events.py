"""Every supervisor state change is a structlog event and a Prometheus metric."""

from __future__ import annotations

import contextlib
from typing import Any

import structlog
from prometheus_client import Counter, Gauge

from actors.telemetry import REGISTRY as _TELEMETRY_REGISTRY

__all__ = ["REGISTRY", "emit", "forget", "set_backoff", "set_quarantined"]

REGISTRY = _TELEMETRY_REGISTRY
"""The registry holding the supervision metrics; the telemetry actor serves it on /metrics."""

_EVENTS = Counter(
    "actorserve_supervisor_events",
    "Supervisor events by kind: started, exited, restarted, start_failed, escalated, backoff, "
    "terminated, ignored, auto_shutdown, quarantined.",
    ["supervisor", "child", "event"],
    registry=REGISTRY,
)
_BACKOFF = Gauge(
    "actorserve_supervisor_backoff_seconds",
    "Delay before a child's pending restart (0 when none is pending).",
    ["supervisor", "child"],
    registry=REGISTRY,
)

_QUARANTINED = Gauge(
    "actorserve_supervisor_child_quarantined",
    "1 while a child is quarantined (left down after crash-looping), else 0.",
    ["supervisor", "child"],
    registry=REGISTRY,
)

_log = structlog.get_logger("actorserve.supervisor")

# Frequent, unremarkable events go out at debug so 100k request streams do not flood the log.
_DEBUG = frozenset({"started", "terminated"})


# The counters' label children, resolved once (a request stream's start and exit emit twice).
_counters: dict[tuple[str, str, str], Any] = {}


# The logger bound for the current structlog configuration, and that configuration's parts.
_bound: tuple[tuple[Any, ...], Any] | None = None


def _logger() -> Any:
    """The module logger, bound once per structlog configuration: the lazy proxy builds a new
    bound logger for every call, which cost a tenth of a request stream's start and exit.
    ``configure()`` again (an embedding app's setup) rebinds it; ``capture_logs`` edits the
    processor list in place, which a bound logger sees."""
    global _bound
    config = structlog.get_config()
    processors, wrapper = config["processors"], config["wrapper_class"]
    factory, context = config["logger_factory"], config["context_class"]
    bound = _bound
    if bound is not None:
        # Compared one by one: a key tuple and a generator per call cost as much as the rest.
        key = bound[0]
        if key[0] is processors and key[1] is wrapper and key[2] is factory and key[3] is context:
            return bound[1]
    bound = _bound = ((processors, wrapper, factory, context), _log.bind())
    return bound[1]


def emit(supervisor: str, child: str, event: str, **fields: Any) -> None:
    key = (supervisor, child, event)
    counter = _counters.get(key)
    if counter is None:
        counter = _counters[key] = _EVENTS.labels(supervisor, child, event)
    counter.inc()
    level = "debug" if event in _DEBUG else "info"
    if event == "exited":
        # A normal exit (a finished request stream) is routine; a crash is not.
        level = "warning" if fields.get("abnormal") else "debug"
    elif event in ("escalated", "start_failed", "quarantined"):
        level = "warning"
    try:
        getattr(_logger(), level)(event, supervisor=supervisor, child=child, **fields)
    except (OSError, ValueError):
        pass  # a closed or broken log stream must never take a supervisor down


def set_backoff(supervisor: str, child: str, seconds: float) -> None:
    _BACKOFF.labels(supervisor, child).set(seconds)


def set_quarantined(supervisor: str, child: str, quarantined: bool) -> None:
    _QUARANTINED.labels(supervisor, child).set(1 if quarantined else 0)


EVENTS = (
    "started",
    "exited",
    "restarted",
    "start_failed",
    "escalated",
    "backoff",
    "terminated",
    "ignored",
    "auto_shutdown",
    "quarantined",
)


def forget(supervisor: str, child: str) -> None:
    """Drop a forgotten child's series (a temporary child, a deleted one): children added with
    fresh ids must not grow the metrics without bound."""
    for event in EVENTS:
        _counters.pop((supervisor, child, event), None)
        _EVENTS.remove(supervisor, child, event)
    for gauge in (_BACKOFF, _QUARANTINED):
        with contextlib.suppress(KeyError):
            gauge.remove(supervisor, child)
