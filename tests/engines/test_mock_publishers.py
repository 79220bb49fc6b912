"""The mock engine's publishers, consumed over ZMQ: KV events (with replay) and load metrics."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import anyio
import msgspec
import pytest
import zmq

from actors._zmq import AsyncSocket
from actors.serving.engines import MockEngine
from actors.serving.worker import KvEventSubscriber, KvMetricsSubscriber, replay_kv_events
from actors.testing import wait_until
from protocols.engine import MemoryTag, PauseMode
from protocols.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KvMetrics,
    decode_kv_event_batch,
)
from protocols.pages import page_hash
from tests.engines._mock_helpers import FAST, config, request, run

T = TypeVar("T")


class PoolView:
    """What a KV-event subscriber believes one rank's prefix cache holds."""

    def __init__(self) -> None:
        self.hashes: set[int] = set()
        self.parents: dict[int, int | None] = {}

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash
                for h in event.block_hashes:
                    assert h not in self.hashes, "stored twice without a removal"
                    self.hashes.add(h)
                    self.parents[h] = parent
                    parent = h
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self.hashes.remove(h)
            else:
                assert isinstance(event, AllBlocksCleared)
                self.hashes.clear()


async def drain(sub: KvEventSubscriber, view: PoolView, last_seq: int) -> None:
    """Apply every batch up to ``last_seq``: a SUB socket misses what was published before its
    subscription reached the publisher, so catch up through the replay socket first."""
    with anyio.fail_after(5):
        for _, batch in await sub.catch_up():
            view.apply(batch)
        while sub.next_seq is None or sub.next_seq <= last_seq:
            for _, batch in await sub.receive():
                view.apply(batch)


async def first_live(engine: MockEngine, receive: Callable[[], Awaitable[T]], tag: str) -> T:
    """Publish (requests with fresh prompts) until ``receive`` gets something: ZMQ's slow
    joiner, a SUB socket sees only what is published after its subscription arrived."""
    for i in range(50):
        await run(engine, request(f"{tag}{i}", [1000 + i, *range(40)]))
        with anyio.move_on_after(0.2):
            return await receive()
    raise AssertionError("the subscription never went live")


async def test_kv_events_rebuild_the_pool_view() -> None:
    # 12 blocks of 16 tokens: enough traffic to evict, so removals happen too.
    async with MockEngine(config(num_blocks=12)) as engine:
        cap = engine.capacity
        async with KvEventSubscriber(
            cap.kv_events_endpoints[0], cap.kv_events_replay_endpoints[0], start_seq=0
        ) as sub:
            view = PoolView()
            for i in range(8):
                await run(engine, request(f"r{i}", [i % 3, *range(40)], max_tokens=20))
            await drain(sub, view, engine.kv_events_last_seq())
            assert view.hashes == engine.cached_block_hashes()
            stats = engine.statistics().ranks[0]
            assert stats.pool.cached + stats.pool.used + stats.pool.free == 12
            assert sub.statistics().missed == 0
            # The chain: the first page of a prompt has no parent, the next ones link to it.
            first = page_hash(None, [0, *range(15)])
            second = page_hash(first, list(range(15, 31)))
            if second in view.hashes:
                assert view.parents[second] == first
            # A flush clears the subscriber's view too.
            assert await engine.flush_cache()
            await drain(sub, view, engine.kv_events_last_seq())
            assert view.hashes == set() == engine.cached_block_hashes()


async def test_wire_format_is_sglangs() -> None:
    async with MockEngine(config(kv_events_topic="kv")) as engine:
        sock = AsyncSocket.create(zmq.SUB)
        try:
            sock.socket.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(engine.capacity.kv_events_endpoints[0])
            topic, seq, payload = await first_live(engine, sock.recv_multipart, "w")
        finally:
            sock.close()
        assert topic == b"kv" and len(seq) == 8 and int.from_bytes(seq, "big") >= 0
        raw = msgspec.msgpack.decode(payload)
        ts, events, rank = raw
        assert isinstance(ts, float) and rank == 0
        tag, hashes, parent, token_ids, block_size, lora_id, medium = events[0]
        assert tag == "BlockStored" and lora_id is None and medium == "GPU" and block_size == 16
        # Chained pages are coalesced into one event (as SGLang's recorder does), each hash
        # chaining its parent's and its own tokens.
        assert len(token_ids) == 16 * len(hashes)
        chain = parent
        for k, h in enumerate(hashes):
            chain = page_hash(chain, token_ids[16 * k : 16 * (k + 1)])
            assert h == chain
        # An older SGLang batch (no medium, no rank) decodes as well.
        old = msgspec.msgpack.encode([1.0, [["BlockRemoved", [5]], ["AllBlocksCleared"]]])
        batch = decode_kv_event_batch(old)
        assert batch.events == [BlockRemoved(block_hashes=[5]), AllBlocksCleared()]


async def test_a_late_subscriber_recovers_missed_batches_through_replay() -> None:
    async with MockEngine(config()) as engine:
        for i in range(3):
            await run(engine, request(f"r{i}", [i, *range(40)]))
        last = engine.kv_events_last_seq()
        assert last >= 2
        cap = engine.capacity
        replayed = await replay_kv_events(cap.kv_events_replay_endpoints[0], 1)
        assert [seq for seq, _ in replayed] == list(range(1, last + 1))
        # A subscriber joining now missed everything; the next live batch reveals the gap.
        async with KvEventSubscriber(
            cap.kv_events_endpoints[0], cap.kv_events_replay_endpoints[0], start_seq=0
        ) as sub:
            view = PoolView()
            # The first live batch reveals the gap, and the replay fills it.
            for _, batch in await first_live(engine, sub.receive, "late"):
                view.apply(batch)
            await drain(sub, view, engine.kv_events_last_seq())
            stats = sub.statistics()
            assert stats.replayed >= last + 1 and stats.missed == 0
            assert view.hashes == engine.cached_block_hashes()


async def test_a_late_subscriber_with_no_live_traffic_catches_up_when_quiet() -> None:
    async with MockEngine(config()) as engine:
        await run(engine, request("a", list(range(40))))
        cap = engine.capacity
        async with KvEventSubscriber(
            cap.kv_events_endpoints[0],
            cap.kv_events_replay_endpoints[0],
            start_seq=0,
            idle_catch_up_s=0.05,
        ) as sub:
            with anyio.fail_after(5):
                got = await sub.receive()
            assert [seq for seq, _ in got] == list(range(engine.kv_events_last_seq() + 1))
            # Nothing new: a quiet catch-up hands out nothing and receive keeps waiting.
            with anyio.move_on_after(0.3):
                await sub.receive()
                raise AssertionError("a batch out of nowhere")
            assert sub.statistics().missed == 0


async def test_a_dropped_batch_is_replayed_in_order() -> None:
    async with MockEngine(config()) as engine:
        cap = engine.capacity
        async with KvEventSubscriber(
            cap.kv_events_endpoints[0], cap.kv_events_replay_endpoints[0]
        ) as sub:
            got = await first_live(engine, sub.receive, "w")
            first = got[-1][0]
            # Simulate a lost message: skip one batch on the wire.
            await run(engine, request("b", [2, *range(40)]))
            assert sub._sock is not None
            with anyio.fail_after(5):
                lost = await sub._sock.recv_multipart()
            assert int.from_bytes(lost[1], "big") == first + 1
            await run(engine, request("c", [3, *range(40)]))
            with anyio.fail_after(5):
                batches = await sub.receive()
            assert [seq for seq, _ in batches] == [first + 1, first + 2]
            assert sub.statistics().replayed >= 1


async def test_catch_up_without_live_traffic() -> None:
    async with MockEngine(config()) as engine:
        await run(engine, request("a", list(range(40))))
        cap = engine.capacity
        sub = KvEventSubscriber(cap.kv_events_endpoints[0], cap.kv_events_replay_endpoints[0])
        got = await sub.catch_up()
        assert [seq for seq, _ in got] == list(range(engine.kv_events_last_seq() + 1))


async def test_replay_timeout_when_nobody_answers() -> None:
    with pytest.raises(TimeoutError):
        await replay_kv_events("tcp://127.0.0.1:9", 0, timeout_s=0.05)


async def test_kv_release_publishes_all_cleared() -> None:
    async with MockEngine(config()) as engine:
        cap = engine.capacity
        async with KvEventSubscriber(
            cap.kv_events_endpoints[0], cap.kv_events_replay_endpoints[0], start_seq=0
        ) as sub:
            view = PoolView()
            await run(engine, request("a", list(range(40))))
            await engine.release_memory([MemoryTag.KV_CACHE])
            await drain(sub, view, engine.kv_events_last_seq())
            assert view.hashes == set()
            await engine.resume_memory([MemoryTag.KV_CACHE])


async def test_metrics_report_the_scheduler_state() -> None:
    cfg = config(dp_size=2, metrics_heartbeat_s=0.02, metrics_interval_s=0.0, timing=FAST)
    async with MockEngine(cfg) as engine:
        endpoint = engine.capacity.metrics_endpoint
        assert endpoint is not None
        async with KvMetricsSubscriber(endpoint) as sub:
            # Two requests on rank 1 (the second one hits the first one's pages), none on 0.
            streams = []
            for i in range(2):
                streams.append(
                    engine.generate(request(f"r{i}", list(range(40)), dp_rank=1, max_tokens=500))
                )
                await wait_until(lambda i=i: engine.phase_of(f"r{i}") == "decode", timeout=5.0)
            await engine.pause(PauseMode.IN_PLACE)
            expected = engine.metrics(1)
            latest: dict[int, KvMetrics] = {}
            with anyio.fail_after(5):
                while latest.get(1) != expected or 0 not in latest:
                    m = await sub.receive()
                    assert m.data_parallel_rank is not None
                    latest[m.data_parallel_rank] = m
            m = latest[1]
            assert (m.request_active_slots, m.request_total_slots) == (2, 16)
            assert m.num_requests_waiting == 0 and m.kv_total_blocks == 64
            assert m.kv_active_blocks == engine.statistics().ranks[1].pool.used > 0
            assert m.gpu_cache_usage_perc == pytest.approx(m.kv_active_blocks / 64)
            assert m.gpu_prefix_cache_hit_rate == pytest.approx(32 / 80)  # 2nd hit 2 pages
            idle = latest[0]
            assert idle.request_active_slots == idle.kv_active_blocks == 0
            for s in streams:
                await s.aclose()


async def test_ipc_endpoints_per_rank(tmp_path: Path) -> None:
    base = f"ipc://{tmp_path}/kv"
    cfg = config(
        dp_size=2,
        kv_events_endpoint=base,
        kv_events_replay_endpoint=f"ipc://{tmp_path}/replay",
        metrics_endpoint=f"ipc://{tmp_path}/metrics",
    )
    async with MockEngine(cfg) as engine:
        cap = engine.capacity
        assert cap.kv_events_endpoints == (base, f"{base}_dp1")
        await run(engine, request("a", list(range(40)), dp_rank=1))
        replayed = await replay_kv_events(cap.kv_events_replay_endpoints[1], 0)
        assert replayed and all(b.attn_dp_rank == 1 for _, b in replayed)


async def test_a_start_that_fails_leaves_nothing_behind() -> None:
    async with MockEngine(config()) as first:
        taken = first.capacity.kv_events_endpoints[0]
        async with anyio.create_task_group() as tg:
            second = MockEngine(config(kv_events_endpoint=taken), task_group=tg)
            with pytest.raises(zmq.ZMQError):
                await second.start()
        assert second.cleanup_runs == 1
