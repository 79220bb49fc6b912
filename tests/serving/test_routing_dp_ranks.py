"""Data-parallel ranks in the routing view: each rank of an engine has its own load and KV cache,
so the router picks a worker *and* a rank, and the request carries the rank to the engine."""

from __future__ import annotations

from typing import Any, cast

import anyio
import httpx
import msgspec

from actors.serving.routing import Policy, RoutingTable, WorkerEntry
from protocols.engine import Capacity, PreprocessedRequest, RoutingHints
from protocols.kv_events import BlockStored, KVEventBatch, KvMetrics
from protocols.pages import prompt_page_hashes
from tests.helpers.serving import serving_tree

PAGE = 4
PROMPT = list(range(100, 118))  # four full pages and a partial one


class _Engine:
    is_running = True


def _table(dp_size: int, workers: int = 1) -> RoutingTable:
    ids = [f"decode-{i}" for i in range(workers)]
    table = RoutingTable(dict.fromkeys(ids, "aggregated"))
    capacity = Capacity(
        total_kv_blocks=64,
        block_size=PAGE,
        max_running_requests=8,
        max_batch_tokens=64,
        context_length=256,
        dp_size=dp_size,
    )
    for worker_id in ids:
        table.register(worker_id, cast(Any, _Engine()), capacity)
    return table


def _store(table: RoutingTable, worker_id: str, dp_rank: int, tokens: list[int]) -> None:
    pages = len(tokens) // PAGE
    event = BlockStored(
        block_hashes=[1000 * dp_rank + i for i in range(pages)],
        parent_block_hash=None,
        token_ids=tokens[: pages * PAGE],
        block_size=PAGE,
    )
    table.kv_events(worker_id, dp_rank, KVEventBatch(ts=0.0, events=[event]))


def _metrics(active: int, waiting: int, usage: float, dp_rank: int) -> KvMetrics:
    return KvMetrics(
        request_active_slots=active,
        request_total_slots=8,
        kv_active_blocks=0,
        kv_total_blocks=64,
        num_requests_waiting=waiting,
        gpu_cache_usage_perc=usage,
        gpu_prefix_cache_hit_rate=0.0,
        data_parallel_rank=dp_rank,
    )


def test_each_rank_keeps_its_own_prefixes_and_kv_aware_picks_the_holder() -> None:
    table = _table(dp_size=4)
    _store(table, "decode-0", 2, PROMPT)
    entry = table.workers["decode-0"]
    assert [len(rank.blocks) for rank in entry.ranks] == [0, 0, 4, 0]
    assert [table.overlap("decode-0", PROMPT, r) for r in range(4)] == [0, 0, 4, 0]
    assert table.overlap("decode-0", PROMPT) == 4  # no rank named: the best one

    routed = table.take("aggregated", "kv_aware", PROMPT)
    assert (routed.worker_id, routed.dp_rank) == ("decode-0", 2)
    assert [rank.active for rank in entry.ranks] == [0, 0, 1, 0] and entry.active == 1
    request = routed.placed(PreprocessedRequest(rid="r", token_ids=PROMPT))
    assert request.routing == RoutingHints(dp_rank=2)
    table.done(routed.worker_id, routed.dp_rank)
    assert entry.active == 0


def test_load_is_tracked_per_rank_and_least_loaded_picks_the_idle_rank() -> None:
    table = _table(dp_size=2)
    table.load("decode-0", 0, _metrics(active=6, waiting=3, usage=0.75, dp_rank=0))
    table.load("decode-0", 1, _metrics(active=1, waiting=0, usage=0.25, dp_rank=1))
    entry = table.workers["decode-0"]
    ranks = [(r.reported_active, r.waiting, r.cache_usage) for r in entry.ranks]
    assert ranks == [(6, 3, 0.75), (1, 0, 0.25)]  # not merged: rank 1 did not overwrite rank 0
    assert (entry.reported_active, entry.waiting, entry.cache_usage) == (7, 3, 0.5)
    assert entry.load() == entry.ranks[1].load()
    for policy in ("least_loaded", "kv_aware"):
        routed = table.take("aggregated", cast(Policy, policy), PROMPT)
        assert routed.dp_rank == 1
        table.done(routed.worker_id, routed.dp_rank)
    # A report from a rank the engine does not have (from before a restart) is ignored.
    table.load("decode-0", 5, _metrics(active=9, waiting=9, usage=1.0, dp_rank=5))
    _store(table, "decode-0", 5, PROMPT)
    assert entry.reported_active == 7 and table.overlap("decode-0", PROMPT) == 0


def test_round_robin_rotates_over_every_rank_of_every_worker() -> None:
    table = _table(dp_size=2, workers=2)
    places = []
    for _ in range(4):
        routed = table.take("aggregated", "round_robin", PROMPT)
        places.append((routed.worker_id, routed.dp_rank))
    assert sorted(places) == [("decode-0", 0), ("decode-0", 1), ("decode-1", 0), ("decode-1", 1)]


def test_a_single_rank_engine_gets_its_request_unchanged() -> None:
    table = _table(dp_size=1, workers=2)
    _store(table, "decode-1", 0, PROMPT)
    routed = table.take("aggregated", "kv_aware", PROMPT)
    assert (routed.worker_id, routed.dp_rank) == ("decode-1", None)
    request = PreprocessedRequest(rid="r", token_ids=PROMPT)
    assert routed.placed(request) is request
    # A continuation that was pinned on a multi-rank worker is unpinned for a single-rank one.
    pinned = routed.placed(msgspec.structs.replace(request, routing=RoutingHints(dp_rank=3)))
    assert pinned.routing == RoutingHints()
    table.done(routed.worker_id, routed.dp_rank)
    assert table.workers["decode-1"].active == 0


async def test_a_repeated_prefix_goes_to_the_rank_that_holds_it() -> None:
    # Real-time decode steps (no speed-up): the long request below is still running while the
    # next one is routed.
    engine_args = {"dp_size": 4, "timing": {"speedup": 1.0}}
    async with serving_tree(
        mode="aggregated", decode_workers=1, engine_args=engine_args, router="kv_aware"
    ) as tree:
        model = tree.serving.model()
        (worker_id,) = model.table.workers
        entry = model.table.workers[worker_id]
        assert len(entry.ranks) == 4
        async with httpx.AsyncClient(base_url=tree.url) as client:

            async def complete(prompt: str, max_tokens: int) -> dict[str, Any]:
                body = {"model": "mock", "prompt": prompt, "temperature": 0}
                body |= {"max_tokens": max_tokens, "min_tokens": max_tokens}
                response = await client.post("/v1/completions", json=body, timeout=60)
                assert response.status_code == 200, response.text
                result: dict[str, Any] = response.json()
                return result

            # A long request holds one rank, so the prompt is routed to another: one the
            # engine would not choose itself once every rank is idle again.
            prefix = "shared context for another rank " * 12
            tokens = model.tokenizer.encode(prefix)
            async with anyio.create_task_group() as tg:
                tg.start_soon(complete, "a long running request " * 8, 2000)
                with anyio.fail_after(10):
                    while entry.active == 0:
                        await anyio.sleep(0.01)
                busy = next(r.rank for r in entry.ranks if r.active)
                await complete(prefix, 4)
                tg.cancel_scope.cancel()  # the client goes away: the long request is aborted
            with anyio.fail_after(10):
                while model.table.overlap(worker_id, tokens) < 5:
                    await anyio.sleep(0.02)
            full = len(prompt_page_hashes(tokens, entry.capacity.block_size, partial=False))
            holders = [r.rank for r in entry.ranks if r.overlap(_hashes(entry, tokens)) == full]
            assert len(holders) == 1 and holders[0] != busy

            second = await complete(prefix + "and a question", 4)
            assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            # Served where its prefix was: no other rank computed it again.
            holders = [r.rank for r in entry.ranks if r.overlap(_hashes(entry, tokens)) == full]
            assert len(holders) == 1 and holders[0] != busy


def _hashes(entry: WorkerEntry, tokens: list[int]) -> list[int]:
    return prompt_page_hashes(tokens, entry.capacity.block_size, partial=False)
