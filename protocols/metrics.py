"""Scheduler load metrics, one record per data-parallel rank.

The fields are SGLang's ``KvMetrics`` (what its schedulers push after every step), so the SGLang
backend converts each message into this struct at once and the mock engine publishes the same
shape; the publisher actor and the router only ever see this type.
"""

from __future__ import annotations

import msgspec

__all__ = ["LoadMetrics"]


class LoadMetrics(msgspec.Struct, frozen=True, kw_only=True):
    """One scheduler's load at one step (SGLang's ``KvMetrics`` fields)."""

    request_active_slots: int = 0  # running requests
    request_total_slots: int = 0  # max running requests
    kv_active_blocks: int = 0
    kv_total_blocks: int = 0
    num_requests_waiting: int = 0
    gpu_cache_usage_perc: float = 0.0  # fraction in [0, 1], despite the name
    gpu_prefix_cache_hit_rate: float = 0.0
    data_parallel_rank: int = 0
