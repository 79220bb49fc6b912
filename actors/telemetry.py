"""The process-wide Prometheus registry every actor exports to; ``/metrics`` serves it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

__all__ = ["REGISTRY"]

REGISTRY = CollectorRegistry(auto_describe=True)
