"""A paged KV block pool with prefix caching, as SGLang's radix cache (paged) gives it.

Every block is in exactly one of three states:

- **used**: referenced by at least one request (reference counted; shared prefixes count once);
- **cached**: unreferenced but holding a registered page (its chained hash is in the prefix index),
  kept for reuse and evicted least-recently-used first;
- **free**: holding nothing reusable.

A block is *registered* (its hash enters the prefix index, and a ``BlockStored`` event is recorded)
when it fills; evicting a cached block records ``BlockRemoved``; a flush or a KV release records
``AllBlocksCleared``. The events are coalesced the way SGLang's recorder does (a store whose
parent is the previous store's last hash extends it; consecutive removals merge), and taken once
per scheduler step as one ``KVEventBatch``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import msgspec

from protocols.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["BlockPool", "BlockPoolStatistics"]

_MEDIUM = "GPU"


class BlockPoolStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """``total == used + cached + free``."""

    total: int
    used: int
    cached: int
    free: int


class BlockPool:
    """One rank's KV blocks: allocation, prefix matching, registration, LRU eviction."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        # Pop from the end: block 0 is handed out first (deterministic layouts in tests).
        self._free = list(range(num_blocks - 1, -1, -1))
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks, oldest first
        self._used = 0
        self._events: list[KVEvent] = []
        self.resets = 0  # times everything was forgotten (see retain)

    # -- queries ----------------------------------------------------------------------------

    @property
    def used(self) -> int:
        return self._used

    def available(self) -> int:
        """Blocks an allocation may take (free ones, then evicted cached ones)."""
        return len(self._free) + len(self._lru)

    def statistics(self) -> BlockPoolStatistics:
        return BlockPoolStatistics(
            total=self.num_blocks, used=self._used, cached=len(self._lru), free=len(self._free)
        )

    def cached_hashes(self) -> set[int]:
        """Every registered page hash (what a KV-event subscriber should believe is stored)."""
        return set(self._by_hash)

    def block_hash(self, block_id: int) -> int | None:
        return self._hash[block_id]

    # -- allocation -------------------------------------------------------------------------

    def match(self, hashes: Sequence[int]) -> list[int]:
        """Reference the longest cached prefix of ``hashes`` (chained page hashes)."""
        out: list[int] = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            self._acquire(block)
            out.append(block)
        return out

    def _acquire(self, block: int) -> None:
        if self._ref[block] == 0:
            self._lru.pop(block, None)
            self._used += 1
        self._ref[block] += 1

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks (evicting cached ones, oldest first), or ``None`` if impossible."""
        if n > self.available():
            return None
        # Free blocks first, then the oldest cached ones: in bulk (a live migration's receiver
        # allocates a whole context's pages, 64 per 4k tokens, for every request of a drain).
        free = self._free
        take = min(n, len(free))
        out = free[len(free) - take :]
        out.reverse()
        del free[len(free) - take :]
        evicted: list[int] = []
        if take < n:
            lru, hashes, by_hash = self._lru, self._hash, self._by_hash
            for _ in range(n - take):
                # A cached block (only those enter the LRU): it leaves the index.
                block, _ = lru.popitem(last=False)
                hash_ = hashes[block]
                assert hash_ is not None
                hashes[block] = None
                del by_hash[hash_]
                evicted.append(hash_)
                out.append(block)
        ref = self._ref
        for block in out:
            ref[block] = 1
        self._used += n
        if evicted:
            # One event for the whole eviction (what merging one per block made, for less work).
            self._record(BlockRemoved(block_hashes=evicted, medium=_MEDIUM))
        return out

    def retain(self, blocks: Sequence[int]) -> int:
        """One more reference on each of ``blocks`` (in use); returns the pool's reset count,
        for :meth:`release_retained`."""
        for block in blocks:
            self._acquire(block)
        return self.resets

    def release_retained(self, blocks: Sequence[int], resets: int) -> None:
        """:meth:`release` of what :meth:`retain` took, unless the pool was reset since."""
        if resets == self.resets:
            self.release(blocks)

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block; the tail first, so it is evicted first."""
        for block in reversed(blocks):
            ref = self._ref[block] - 1
            self._ref[block] = ref
            if ref:
                continue
            self._used -= 1
            if self._hash[block] is None:
                self._free.append(block)
            else:
                self._lru[block] = None

    # -- registration -----------------------------------------------------------------------

    def register(self, block: int, hash_: int, parent: int | None, tokens: Sequence[int]) -> bool:
        """Index a filled block under ``hash_``; ``False`` if that page is already cached
        elsewhere (the duplicate stays private to its request and is freed, not cached)."""
        if hash_ in self._by_hash or self._hash[block] is not None:
            return False
        self._by_hash[hash_] = block
        self._hash[block] = hash_
        self._record(
            BlockStored(
                block_hashes=[hash_],
                parent_block_hash=parent,
                token_ids=list(tokens),
                block_size=len(tokens),
                lora_id=None,
                medium=_MEDIUM,
            )
        )
        return True

    def register_pages(
        self, blocks: Sequence[int], hashes: Sequence[int], tokens: list[int]
    ) -> None:
        """:meth:`register` for a whole chain: ``blocks[i]`` holds page ``i`` (tokens
        ``[i*bs, (i+1)*bs)``) of hash ``hashes[i]``; one ``BlockStored`` per run of pages not
        cached already (a received context registers at once)."""
        by_hash, block_hash = self._by_hash, self._hash
        run = 0  # the first page of the current run
        for p, (block, hash_) in enumerate(zip(blocks, hashes, strict=True)):
            if hash_ in by_hash or block_hash[block] is not None:
                self._store_run(hashes, tokens, run, p)
                run = p + 1
                continue
            by_hash[hash_] = block
            block_hash[block] = hash_
        self._store_run(hashes, tokens, run, len(blocks))

    def _store_run(self, hashes: Sequence[int], tokens: list[int], first: int, end: int) -> None:
        if first < end:
            bs = self.block_size
            self._record(
                BlockStored(
                    block_hashes=list(hashes[first:end]),
                    parent_block_hash=hashes[first - 1] if first else None,
                    token_ids=tokens[first * bs : end * bs],  # a list's slice: a new list
                    block_size=bs,
                    lora_id=None,
                    medium=_MEDIUM,
                )
            )

    def flush(self) -> bool:
        """Drop every cached page; only possible when no block is in use (SGLang's rule)."""
        if self._used:
            return False
        self.reset()
        return True

    def reset(self) -> None:
        """Forget everything (flush, or the KV memory was released): all blocks free."""
        self.resets += 1
        had_pages = bool(self._by_hash)
        self._ref = [0] * self.num_blocks
        self._hash = [None] * self.num_blocks
        self._by_hash.clear()
        self._lru.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._used = 0
        if had_pages or self._events:
            self._events.append(AllBlocksCleared())

    # -- events -----------------------------------------------------------------------------

    def _record(self, event: BlockStored | BlockRemoved) -> None:
        if self._events:
            tail = self._events[-1]
            if isinstance(event, BlockRemoved) and isinstance(tail, BlockRemoved):
                tail.block_hashes.extend(event.block_hashes)
                return
            if (
                isinstance(event, BlockStored)
                and isinstance(tail, BlockStored)
                and tail.block_size == event.block_size
                and event.parent_block_hash == tail.block_hashes[-1]
            ):
                tail.block_hashes.extend(event.block_hashes)
                tail.token_ids.extend(event.token_ids)
                return
        self._events.append(event)

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
