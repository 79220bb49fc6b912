"""Statistics and introspection of the mock engine (the project's ``statistics()`` convention:
frozen records), for tests, benchmarks and the KV-transfer layer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from actors.serving.engines._mock._image import ImageJobs
from actors.serving.engines._mock._kvmem import KvMemoryInfo, KvPageMemory
from actors.serving.engines._mock._loop import StepRecord
from actors.serving.engines._mock._pool import BlockPoolStatistics
from actors.serving.engines._mock._request import MockRequest, Phase
from actors.serving.engines._mock._scheduler import RankScheduler
from protocols.engine import MemoryTag
from protocols.kv_events import KvMetrics
from protocols.pages import prompt_page_hashes

__all__ = ["IntrospectionMixin", "MockEngineStatistics", "RankStatistics"]


class RankStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """One data-parallel rank: queues, work done, simulated time and its block pool."""

    dp_rank: int
    waiting: int
    running: int  # prefilling, decoding or awaiting KV (each holds a slot)
    awaiting_kv: int
    owed: int  # prefill role: finished requests whose KV the decode side has not taken yet
    steps: int
    prefill_tokens: int  # tokens computed by prefill (cache hits excluded)
    generated_tokens: int
    retractions: int
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    kv_received_tokens: int  # prompt tokens whose KV arrived by transfer (not computed here)
    handed_over: int  # requests whose KV this rank handed over (live migration)
    simulated_s: float  # what the timing model charged for all steps
    kv_events_seq: int  # last KV event batch published (-1: none)
    pool: BlockPoolStatistics

    @classmethod
    def of(cls, sched: RankScheduler) -> RankStatistics:
        return cls(
            dp_rank=sched.rank,
            waiting=len(sched.waiting),
            running=len(sched.running),
            awaiting_kv=sum(r.phase is Phase.AWAITING_KV for r in sched.running),
            owed=len(sched.owed),
            steps=sched.steps,
            prefill_tokens=sched.prefill_tokens,
            generated_tokens=sched.generated,
            retractions=sched.retractions,
            prompt_tokens=sched.prompt_tokens,
            cached_tokens=sched.cached_tokens,
            kv_received_tokens=sched.kv_received_tokens,
            handed_over=sched.handed_over,
            simulated_s=sched.simulated_s,
            kv_events_seq=sched.events.last_seq if sched.events is not None else -1,
            pool=sched.pool.statistics(),
        )


class MockEngineStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """The engine contract's ``EngineStatistics``, with each rank's details."""

    ranks: tuple[RankStatistics, ...]
    in_flight: int  # requests whose streams have not ended
    released_tags: tuple[str, ...]

    @property
    def released(self) -> frozenset[MemoryTag]:
        return frozenset(MemoryTag(t) for t in self.released_tags)

    @property
    def generated_tokens(self) -> int:
        return sum(r.generated_tokens for r in self.ranks)

    @property
    def prefill_tokens(self) -> int:
        return sum(r.prefill_tokens for r in self.ranks)

    @property
    def kv_received_tokens(self) -> int:
        return sum(r.kv_received_tokens for r in self.ranks)

    @property
    def used_blocks(self) -> int:
        return sum(r.pool.used for r in self.ranks)


class IntrospectionMixin:
    """The read-only views of ``MockEngine``."""

    _ranks: list[RankScheduler]
    _memories: list[KvPageMemory]
    _requests: dict[str, MockRequest]
    _released: set[MemoryTag]
    _images: ImageJobs

    def _find(self, rid: str) -> MockRequest | None:
        raise NotImplementedError

    def statistics(self) -> MockEngineStatistics:
        return MockEngineStatistics(
            ranks=tuple(RankStatistics.of(s) for s in self._ranks),
            in_flight=len(self._requests) + self._images.statistics().in_flight,
            released_tags=tuple(sorted(t.value for t in self._released)),
        )

    def metrics(self, dp_rank: int = 0) -> KvMetrics:
        """The load metrics rank ``dp_rank`` publishes, computed now."""
        return self._ranks[dp_rank].metrics()

    def step_records(self, dp_rank: int = 0) -> list[StepRecord]:
        """Every step so far (only with ``record_steps``)."""
        return list(self._ranks[dp_rank].records)

    def cached_block_hashes(self, dp_rank: int = 0) -> set[int]:
        """The page hashes rank ``dp_rank``'s prefix cache holds (what KV events describe)."""
        return self._ranks[dp_rank].pool.cached_hashes()

    def kv_events_last_seq(self, dp_rank: int = 0) -> int:
        """Sequence number of the last KV event batch rank ``dp_rank`` published (-1: none)."""
        events = self._ranks[dp_rank].events
        return events.last_seq if events is not None else -1

    def kv_memory(self, dp_rank: int = 0) -> KvMemoryInfo:
        """Address, size and layout of rank ``dp_rank``'s KV pages (for NIXL registration)."""
        return self._memories[dp_rank].info()

    def kv_buffer(self, dp_rank: int = 0) -> Any:
        """Rank ``dp_rank``'s pages as a ``(num_blocks, block_bytes)`` uint8 array (or tensor)."""
        return self._memories[dp_rank].buffer()

    def verify_block(self, block_id: int, page_hash: int, dp_rank: int = 0) -> bool:
        """Whether ``block_id`` holds the content of the page with chained hash ``page_hash``."""
        return self._memories[dp_rank].verify(block_id, page_hash)

    def verify_pages(
        self, block_ids: Sequence[int], tokens: Sequence[int], dp_rank: int = 0
    ) -> list[int]:
        """Indices of the pages of ``tokens`` (in ``block_ids``, page i in block_ids[i]) whose
        content is wrong; empty when every page, the trailing partial one included, is right."""
        hashes = prompt_page_hashes(tokens, self._ranks[dp_rank].cfg.block_size)
        return self._memories[dp_rank].bad_pages(block_ids, hashes)

    def block_checksum(self, block_id: int, dp_rank: int = 0) -> int:
        """The checksum of what ``block_id`` holds (compare with ``page_checksum``)."""
        return self._memories[dp_rank].checksum(block_id)

    def phase_of(self, rid: str) -> str | None:
        """The phase of an in-flight request (``waiting``, ``prefill``, ...), else ``None``."""
        req = self._find(rid)
        return req.phase.value if req is not None and req.phase is not Phase.FINISHED else None
