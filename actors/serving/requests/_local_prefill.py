"""Conditional disaggregation: whether a disaggregated request's decode worker prefills it.

As SGLang and Dynamo do, a prefill worker is not always worth its KV transfer: the decode worker
computes the prompt's KV itself (the decode-only path) when the part of the prompt it does not
hold yet is short, or when the prefill pool's queue is long. A decode engine that cannot prefill
alone (SGLang's decode mode) always waits for a prefill worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import get_args

import attrs
import structlog

from actors.serving.requests._metrics import PREFILL_DECISIONS, LocalReason, RemoteReason
from actors.serving.routing import Routed, RoutingTable

__all__ = ["Decision", "LocalPrefill"]

_log = structlog.get_logger("actorserve.request")

_LOCAL: tuple[LocalReason, ...] = get_args(LocalReason)


@attrs.frozen
class Decision:
    """Where one attempt is prefilled, why, and what that was decided on (``None``: not looked
    up)."""

    reason: LocalReason | RemoteReason
    uncached: int | None = None  # prompt tokens the decode worker does not hold yet
    queue: float | None = None  # the least loaded prefill worker's load

    @property
    def local(self) -> bool:
        return self.reason in _LOCAL

    def record(self, model: str, rid: str) -> None:
        """Count it, and log it at debug."""
        decision = "local" if self.local else "remote"
        PREFILL_DECISIONS.labels(model, decision, self.reason).inc()
        _log.debug(
            "prefill decision",
            attempt=rid,
            decision=decision,
            reason=self.reason,
            uncached=self.uncached,
            prefill_queue=self.queue,
        )


@attrs.frozen
class LocalPrefill:
    """The thresholds: a decode worker prefills a request itself when at most ``max_tokens`` of
    its prompt are not in that worker's KV cache (0 turns local prefill off altogether), or when
    every routable prefill worker's load (requests it holds, running or queued) is ``queue`` or
    more."""

    max_tokens: int = 0
    queue: int = 4

    def decide(self, table: RoutingTable, decode: Routed, tokens: Sequence[int]) -> Decision:
        """Where the request with prompt ``tokens``, routed to ``decode``, is prefilled."""
        if not decode.prefills_alone:
            return Decision("decode_cannot_prefill")
        if self.max_tokens <= 0:
            return Decision("off")
        uncached = len(tokens)
        if uncached > self.max_tokens:
            # Only a long prompt needs the KV index: the pages the decode rank already holds.
            entry = table.workers.get(decode.worker_id)
            if entry is not None:
                held = table.overlap(decode.worker_id, tokens, decode.dp_rank)
                uncached -= held * entry.capacity.block_size
        if uncached <= self.max_tokens:
            return Decision("short_prompt", uncached)
        prefills = table.candidates("prefill")
        queue = min((w.load() for w in prefills), default=None)
        if queue is not None and queue >= self.queue:
            return Decision("prefill_queue", uncached, queue)
        return Decision("long_prompt", uncached, queue)
