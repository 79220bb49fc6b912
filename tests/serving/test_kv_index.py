"""The router's prefix index, fed by KV events hashed the engine's own way: pages are matched by
hashes the router computes from their tokens, so an engine hashing with SHA-256 (SGLang 0.5.17)
routes as one hashing as the router does (the mock)."""

from __future__ import annotations

import hashlib
from typing import Any, cast

from actors.serving.routing import RoutingTable, WorkerEntry
from protocols.engine import Capacity
from protocols.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from protocols.pages import prompt_page_hashes

PAGE = 4
PROMPT = list(range(100, 118))  # four full pages and a partial one


def _sha_hash(parent: int | None, tokens: list[int]) -> int:
    # SGLang 0.5.17's scheme: the leading 64 bits of a chained SHA-256, as a signed int.
    digest = hashlib.sha256(f"{parent}:{tokens}".encode()).hexdigest()
    value = int(digest[:16], 16)
    return value - (1 << 64) if value >= 1 << 63 else value


def _table() -> RoutingTable:
    table = RoutingTable({"decode-0": "aggregated"})
    capacity = Capacity(
        total_kv_blocks=64,
        block_size=PAGE,
        max_running_requests=8,
        max_batch_tokens=64,
        context_length=256,
    )
    engine = cast(Any, object())
    table.workers["decode-0"] = WorkerEntry("decode-0", "aggregated", engine, capacity)
    return table


def _store_page_by_page(table: RoutingTable, tokens: list[int]) -> list[int]:
    """One BlockStored per page (SGLang 0.5.17's form), the partial tail included."""
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(tokens), PAGE):
        page = tokens[start : start + PAGE]
        h = _sha_hash(parent, page)
        event = BlockStored(
            block_hashes=[h], parent_block_hash=parent, token_ids=page, block_size=len(page)
        )
        table.kv_events("decode-0", 0, KVEventBatch(ts=0.0, events=[event]))
        hashes.append(h)
        parent = h
    return hashes


def test_pages_hashed_by_the_engine_its_own_way_are_matched_by_their_tokens() -> None:
    table = _table()
    engine_hashes = _store_page_by_page(table, PROMPT)
    assert table.overlap("decode-0", PROMPT) == 4
    assert table.overlap("decode-0", [*PROMPT[:8], 1, 2, 3, 4]) == 2  # a shared prefix
    assert table.overlap("decode-0", [7, *PROMPT[1:]]) == 0
    assert table.workers["decode-0"].ranks[0].blocks == set(
        prompt_page_hashes(PROMPT, PAGE, partial=False)
    )

    # Evicting the third page (by the engine's hash) shortens the match to two pages.
    removed = BlockRemoved(block_hashes=[engine_hashes[2]])
    table.kv_events("decode-0", 0, KVEventBatch(ts=0.0, events=[removed]))
    assert table.overlap("decode-0", PROMPT) == 2
    table.kv_events("decode-0", 0, KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
    assert table.overlap("decode-0", PROMPT) == 0
    assert table.workers["decode-0"].ranks[0].engine_hashes == {}


def test_several_pages_in_one_event_and_an_unknown_parent() -> None:
    table = _table()
    # The mock's form: one event for a chain of pages, tokens concatenated.
    event = BlockStored(
        block_hashes=[11, 12, 13], parent_block_hash=None, token_ids=PROMPT[:12], block_size=PAGE
    )
    table.kv_events("decode-0", 0, KVEventBatch(ts=0.0, events=[event]))
    assert table.overlap("decode-0", PROMPT) == 3
    # Pages whose parent was never seen (an event lost) cannot be placed: nothing is guessed.
    orphan = BlockStored(
        block_hashes=[99], parent_block_hash=98, token_ids=PROMPT[12:16], block_size=PAGE
    )
    table.kv_events("decode-0", 0, KVEventBatch(ts=0.0, events=[orphan]))
    assert table.overlap("decode-0", PROMPT) == 3
    assert 99 not in table.workers["decode-0"].ranks[0].engine_hashes
