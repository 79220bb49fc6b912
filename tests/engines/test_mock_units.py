"""Unit tests of the mock engine's parts: tokens, block pool, pages, timing, config, wire."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.serving.engines import (
    MockEngineConfig,
    TimingModel,
    offset_endpoint,
    page_checksum,
    page_content,
)
from actors.serving.engines._mock._pages import expected_kv
from actors.serving.engines._mock._pool import BlockPool
from actors.serving.engines._mock._request import MockRequest
from actors.serving.engines._mock._tokens import TokenModel
from protocols.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KvMetrics,
    decode_kv_event_batch,
    decode_kv_metrics,
    encode_kv_event_batch,
    encode_kv_metrics,
)
from protocols.pages import page_hash, prompt_page_hashes
from tests.engines._mock_helpers import request


@given(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=300))
def test_rolling_hash_matches_the_whole_prefix_hash(tokens: list[int]) -> None:
    model = TokenModel(1000, 2, 0.1)
    h = model.prefix_hash(tokens[:1])
    for t in tokens[1:]:
        h = model.extend(h, t)
    assert h == model.prefix_hash(tokens)
    arr = np.array([model.prefix_hash(tokens[:-1])], dtype=np.uint64)
    model.extend_in_place(arr, np.array(tokens[-1:], dtype=np.int64))
    assert int(arr[0]) == h
    # A hand-over recovers the hash of all but the newest token from the whole one's.
    assert model.retract(h, tokens[-1]) == model.prefix_hash(tokens[:-1])


def test_prefix_hash_of_long_sequences_matches_the_rolling_hash() -> None:
    # Its powers table grows by doubling (a running uint64 product): check past several growths.
    model = TokenModel(1000, 2, 0.1)
    tokens = [(i * 7919) % 1000 for i in range(5000)]
    h = model.prefix_hash(tokens[:1])
    for n, t in enumerate(tokens[1:], start=2):
        h = model.extend(h, t)
        if n in (2, 3, 1023, 1024, 1025, 4097, 5000):
            assert model.prefix_hash(tokens[:n]) == h
            assert model.prefix_hash(np.array(tokens[:n], dtype=np.int64)) == h


def test_next_tokens_are_in_the_vocabulary_and_skip_eos() -> None:
    model = TokenModel(50, 7, 0.25)
    hs = np.array([model.prefix_hash([i, i + 1]) for i in range(20_000)], dtype=np.uint64)
    seeds = np.full(len(hs), model.seed_word(3, greedy=False), dtype=np.uint64)
    regular, eos = model.next_tokens(hs, seeds)
    assert regular.min() >= 0 and regular.max() < 50 and 7 not in regular
    assert eos is not None and abs(eos.mean() - 0.25) < 0.02
    assert model.next_token(int(hs[5]), int(seeds[0])) == (int(regular[5]), bool(eos[5]))
    assert model.seed_word(3, greedy=True) == model.seed_word(4, greedy=True)
    assert model.seed_word(3, greedy=False) != model.seed_word(4, greedy=False)
    assert TokenModel(50, 7, 0.0).next_tokens(hs, seeds)[1] is None
    assert model.alternative(6, frozenset({8})) == 9  # skips EOS (7) and the banned 8


def test_pool_prefix_matching_lru_eviction_and_statistics() -> None:
    pool = BlockPool(4, 2)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.statistics().used == 3
    for i, b in enumerate(a):
        assert pool.register(b, 100 + i, 100 + i - 1 if i else None, [i, i])
    assert not pool.register(3, 100, None, [0, 0])  # a duplicate page stays private
    pool.release(a)
    stats = pool.statistics()
    assert (stats.used, stats.cached, stats.free) == (0, 3, 1)
    assert pool.match([100, 101, 999]) == [0, 1]  # the longest cached prefix
    pool.release([0, 1])
    # Released tail first: block 2 (page 102) is the oldest cached block and goes first.
    assert pool.allocate(2) == [3, 2]
    assert pool.cached_hashes() == {100, 101}
    assert pool.allocate(3) is None  # only 2 left
    assert not pool.flush()  # blocks in use
    pool.release([3, 2])
    assert pool.flush() and pool.cached_hashes() == set()
    assert pool.statistics().free == 4
    events = pool.take_events()
    assert isinstance(events[0], BlockStored) and events[0].block_hashes == [100, 101, 102]
    assert events[0].token_ids == [0, 0, 1, 1, 2, 2] and events[0].parent_block_hash is None
    assert events[1] == BlockRemoved(block_hashes=[102], medium="GPU")
    assert isinstance(events[2], AllBlocksCleared) and len(events) == 3
    assert pool.take_events() == []


def test_pool_retained_blocks_stay_in_use_until_released() -> None:
    pool = BlockPool(4, 2)
    blocks = pool.allocate(2)
    assert blocks is not None
    resets = pool.retain(blocks)  # a failed transfer's pages: a WRITE may still reach them
    pool.release(blocks)  # their request ended
    assert pool.statistics().used == 2 and pool.allocate(3) is None
    pool.release_retained(blocks, resets)
    assert pool.statistics().free == 4
    # Retained before a reset (the KV memory was released): nothing to give back after it.
    again = pool.allocate(1)
    assert again is not None
    resets = pool.retain(again)
    pool.reset()
    pool.release_retained(again, resets)
    assert pool.statistics().free == 4 and pool.allocate(4) is not None


def test_pool_registers_a_chain_as_one_event_per_run() -> None:
    tokens = list(range(12))
    hashes = [200 + i for i in range(6)]
    chained, paged = BlockPool(16, 2), BlockPool(16, 2)
    for pool in (chained, paged):
        other = pool.allocate(1)
        assert other is not None and pool.register(other[0], 202, 201, [4, 5])  # cached already
        pool.take_events()
    blocks = [4, 5, 6, 7, 8, 9]
    chained.register_pages(blocks, hashes, tokens)
    for p, (block, h) in enumerate(zip(blocks, hashes, strict=True)):
        paged.register(block, h, hashes[p - 1] if p else None, tokens[2 * p : 2 * p + 2])
    events = chained.take_events()
    assert events == paged.take_events()
    assert [e.block_hashes for e in events if isinstance(e, BlockStored)] == [
        [200, 201],
        [203, 204, 205],  # page 2 stays private: its hash is cached in another block
    ]
    assert chained.cached_hashes() == paged.cached_hashes() == {*hashes}
    assert chained.block_hash(6) is None and chained.block_hash(7) == 203


def test_page_hashes_chain_and_content() -> None:
    tokens = list(range(37))
    hashes = prompt_page_hashes(tokens, 16)
    assert len(hashes) == 3 and len(prompt_page_hashes(tokens, 16, partial=False)) == 2
    assert hashes[0] == page_hash(None, tokens[:16])
    assert hashes[1] == page_hash(hashes[0], tokens[16:32])
    assert hashes[2] == page_hash(hashes[1], tokens[32:])
    assert prompt_page_hashes(np.array(tokens, dtype=np.int64), 16) == hashes
    assert page_hash(None, [1, 2]) != page_hash(None, [2, 1])
    assert -(2**63) <= hashes[0] < 2**63
    content = page_content(hashes[0], 256)
    assert content.shape == (256,) and content.dtype == np.uint8
    assert np.array_equal(content, page_content(hashes[0], 256))
    assert not np.array_equal(content, page_content(hashes[1], 256))
    rows = content.reshape(4, 64)
    assert len({bytes(r) for r in rows}) == 4  # every 64-byte row differs
    words = content.view(np.uint64)
    assert page_checksum(hashes[0], 256) == int(words.sum(dtype=np.uint64))


def _chain(tokens: list[int], bs: int, partial: bool = True) -> list[int]:
    """Page hashes one :func:`page_hash` at a time (the reference)."""
    end = len(tokens) if partial else len(tokens) - len(tokens) % bs
    hashes: list[int] = []
    for start in range(0, end, bs):
        hashes.append(page_hash(hashes[-1] if hashes else None, tokens[start : start + bs]))
    return hashes


def test_page_hashes_of_whole_contexts_equal_the_chain_page_by_page() -> None:
    model = TokenModel(300, 257, 0.0)
    rng = np.random.default_rng(3)
    lengths = [0, 1, 15, 16, 17, 64, 100, 4103]  # empty, partial only, exact pages, partial tail
    prompts = [[int(t) for t in rng.integers(0, 1 << 40, n)] for n in lengths]
    for prompt in prompts:
        arr = np.array(prompt, dtype=np.int64)
        for partial in (True, False):
            want = _chain(prompt, 16, partial)
            assert prompt_page_hashes(prompt, 16, partial=partial) == want
            assert prompt_page_hashes(arr, 16, partial=partial) == want
    # What a live migration's receiver expects, for several requests of different lengths:
    # the same hashes, so byte-identical page content, and the whole prompt's prefix hash.
    for i, prompt in enumerate(p for p in prompts if p):
        req = MockRequest(
            request(f"r{i}", prompt),
            0,
            max_new=8,
            min_new=0,
            stop=frozenset(),
            seed_word=0,
            bootstrap=None,
        )
        got = expected_kv(req, 16, model)
        want = _chain(prompt, 16)
        assert got.prompt == prompt and got.hashes == want
        assert got.prefix_hash == model.prefix_hash(prompt)
        for g, w in zip(got.hashes, want, strict=True):
            assert np.array_equal(page_content(g, 256), page_content(w, 256))


def test_timing_model_is_dynamos_mocker() -> None:
    timing = TimingModel()
    assert timing.prefill_ms(1000) == pytest.approx(4.21e-7 * 1e6 + 15.2 + 16.5)
    assert timing.decode_ms(0.5) == pytest.approx(-25.74 / 4 + 27.005 + 5.74)
    assert timing.step_seconds(1000, True, 0.5) == pytest.approx(
        (timing.prefill_ms(1000) + timing.decode_ms(0.5)) / 1000
    )
    assert timing.step_seconds(0, True, 0.0) == pytest.approx(5.74e-3)
    assert TimingModel(speedup=2.0).step_seconds(0, True, 0.0) == pytest.approx(2.87e-3)
    assert TimingModel(instant=True).step_seconds(1000, True, 0.5) == 0.0
    with pytest.raises(ValueError):
        TimingModel(speedup=0.0)


def test_config_is_a_plain_struct_with_validation() -> None:
    cfg = MockEngineConfig(dp_size=2, timing=TimingModel(speedup=3.0))
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(cfg), type=MockEngineConfig)
    assert again == cfg
    assert cfg.kv_bytes_total == 16384 * 4096 and cfg.blocks_for(65) == 2
    with pytest.raises(ValueError):
        MockEngineConfig(kv_events_endpoint="tcp://0.0.0.0:5557")
    with pytest.raises(ValueError):
        MockEngineConfig(num_blocks=0)
    assert offset_endpoint("tcp://127.0.0.1:5557", 2) == "tcp://127.0.0.1:5559"
    assert offset_endpoint("tcp://127.0.0.1:0", 2) == "tcp://127.0.0.1:0"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"


def test_wire_round_trips() -> None:
    batch = KVEventBatch(
        ts=1.5,
        events=[
            BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[3], block_size=1),
            BlockRemoved(block_hashes=[1]),
            AllBlocksCleared(),
        ],
        attn_dp_rank=1,
    )
    assert decode_kv_event_batch(encode_kv_event_batch(batch)) == batch
    metrics = KvMetrics(
        request_active_slots=1,
        request_total_slots=2,
        kv_active_blocks=3,
        kv_total_blocks=4,
        num_requests_waiting=5,
        gpu_cache_usage_perc=0.75,
        gpu_prefix_cache_hit_rate=0.5,
        data_parallel_rank=1,
    )
    raw = encode_kv_metrics(metrics)
    assert msgspec.msgpack.decode(raw)["kv_active_blocks"] == 3  # a map with SGLang's names
    assert decode_kv_metrics(raw) == metrics
