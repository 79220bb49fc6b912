"""Contract tests of the mock engine, in-process: streaming, usage, determinism, stop
conditions, abort, pause, data parallelism, cleanup."""

from __future__ import annotations

import gc
import math

import anyio
import msgspec
import pytest

from actors.serving.engines import MockEngine, TimingModel
from actors.testing import wait_until
from protocols.engine import Engine, MemoryTag, PauseMode
from protocols.errors import ContextLengthExceeded, EngineShutdown, InvalidRequest
from tests.engines._mock_helpers import (
    FAST,
    collect,
    config,
    request,
    run,
    tokens_of,
)

PROMPT = list(range(100, 140))  # 40 tokens: 2 full pages of 16 and a partial one


async def test_is_an_engine_and_reports_capacity() -> None:
    async with MockEngine(config(dp_size=2)) as engine:
        assert isinstance(engine, Engine)
        cap = engine.capacity
        assert (cap.total_kv_blocks, cap.block_size, cap.dp_size) == (64, 16, 2)
        assert len(cap.kv_events_endpoints) == len(cap.kv_events_replay_endpoints) == 2
        assert all(e.startswith("tcp://127.0.0.1:") for e in cap.kv_events_endpoints)
        assert cap.metrics_endpoint is not None and cap.bootstrap is None


async def test_streams_new_tokens_only_with_usage_on_the_last() -> None:
    async with MockEngine(config(timing=FAST)) as engine:
        outputs = await collect(engine.generate(request("a", PROMPT, max_tokens=12)))
        assert len(tokens_of(outputs)) == 12
        assert all(o.finish_reason is None and o.usage is None for o in outputs[:-1])
        last = outputs[-1]
        assert last.finish_reason == "length"
        assert last.usage is not None
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (40, 12)
        assert last.usage.cached_tokens == 0
        assert len(outputs) > 1  # timed steps: tokens arrive as they are made


async def test_repeated_prefix_is_served_from_the_cache() -> None:
    async with MockEngine(config()) as engine:
        await run(engine, request("a", PROMPT))
        _, last = await run(engine, request("b", [*PROMPT, 7, 8, 9]))
        assert last.usage is not None and last.usage.cached_tokens == 32  # 2 full pages
        # A prompt that is entirely cached still computes its last token (SGLang's rule).
        _, last = await run(engine, request("c", PROMPT[:32]))
        assert last.usage is not None and last.usage.cached_tokens == 16
        stats = engine.statistics().ranks[0]
        assert stats.cached_tokens == 48 and stats.prompt_tokens == 40 + 43 + 32


async def test_same_seed_same_tokens_and_continuation_after_k() -> None:
    async with MockEngine(config()) as engine:
        full, _ = await run(engine, request("a", PROMPT, max_tokens=30, seed=7))
        again, _ = await run(engine, request("b", PROMPT, max_tokens=30, seed=7))
        assert full == again
        other, _ = await run(engine, request("c", PROMPT, max_tokens=30, seed=8))
        assert other != full
        for k in (1, 5, 17):
            rest, _ = await run(
                engine, request(f"k{k}", PROMPT + full[:k], max_tokens=30 - k, seed=7)
            )
            assert rest == full[k:]


async def test_logprobs_one_per_token_the_chosen_most_likely_and_the_same_after_k() -> None:
    async with MockEngine(config()) as engine:
        wanted = msgspec.structs.replace(request("a", PROMPT, max_tokens=20), logprobs=3)
        outputs = await collect(engine.generate(wanted))
        assert all(len(o.logprobs or ()) == len(o.token_ids) for o in outputs)
        full = [lp for o in outputs for lp in o.logprobs or ()]
        for token, entry in zip(tokens_of(outputs), full, strict=True):
            assert entry.top_ids[0] == token and entry.top_logprobs[0] == entry.logprob
            assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)
            assert sum(math.exp(lp) for lp in entry.top_logprobs) < 1
        rest = msgspec.structs.replace(
            request("c", PROMPT + tokens_of(outputs)[:5], max_tokens=15), logprobs=3
        )
        continued = await collect(engine.generate(rest))
        assert [lp for o in continued for lp in o.logprobs or ()] == full[5:]
        plain = await collect(engine.generate(request("b", PROMPT, max_tokens=3)))
        assert all(o.logprobs is None for o in plain)


async def test_determinism_across_engines_and_dp_ranks() -> None:
    async with MockEngine(config()) as one, MockEngine(config(dp_size=2)) as two:
        a, _ = await run(one, request("a", PROMPT, max_tokens=20, temperature=0.0))
        b, _ = await run(two, request("b", PROMPT, max_tokens=20, temperature=0.0, dp_rank=1))
        assert a == b
        # Greedy ignores the seed; an unseeded sampled request uses the engine's default seed.
        c, _ = await run(one, request("c", PROMPT, max_tokens=20, temperature=0.0, seed=99))
        d, _ = await run(one, request("d", PROMPT, max_tokens=20))
        e, _ = await run(two, request("e", PROMPT, max_tokens=20, seed=0))
        assert c == a and d == e != a


async def test_eos_stops_unless_ignored_and_min_tokens_hold_it_back() -> None:
    async with MockEngine(config(eos_rate=0.3)) as engine:
        eos = engine.config.eos_token_id
        tokens, last = await run(engine, request("a", PROMPT, max_tokens=200))
        assert last.finish_reason == "stop" and tokens[-1] == eos and eos not in tokens[:-1]
        n = len(tokens)
        ignoring, last = await run(engine, request("b", PROMPT, max_tokens=40, ignore_eos=True))
        assert last.finish_reason == "length" and len(ignoring) == 40
        assert ignoring[: n - 1] == tokens[:-1] and ignoring[n - 1] == eos  # EOS is emitted
        held, last = await run(engine, request("c", PROMPT, max_tokens=200, min_tokens=n + 3))
        assert held[: n - 1] == tokens[: n - 1] and eos not in held[: n + 3]
        assert last.finish_reason == "stop" and len(held) > n + 3 and held[-1] == eos


async def test_stop_token_ids_and_request_eos_ids() -> None:
    async with MockEngine(config()) as engine:
        base, _ = await run(engine, request("a", PROMPT, max_tokens=20))
        target = base[6]
        first = base.index(target)
        tokens, last = await run(
            engine, request("b", PROMPT, max_tokens=20, stop_token_ids=[target])
        )
        assert last.finish_reason == "stop" and tokens == base[: first + 1]
        tokens, last = await run(
            engine, request("c", PROMPT, max_tokens=20, eos_token_ids=[target])
        )
        assert last.finish_reason == "stop" and tokens == base[: first + 1]
        tokens, _ = await run(
            engine,
            request("d", PROMPT, max_tokens=20, eos_token_ids=[target], ignore_eos=True),
        )
        assert tokens == base


async def test_max_tokens_zero_and_limits() -> None:
    async with MockEngine(config(context_length=64)) as engine:
        tokens, last = await run(engine, request("a", PROMPT, max_tokens=0))
        assert tokens == [] and last.finish_reason == "length"
        tokens, last = await run(engine, request("b", PROMPT, max_tokens=None))
        assert len(tokens) == 64 - 40 and last.finish_reason == "length"
        with pytest.raises(ContextLengthExceeded):
            await collect(engine.generate(request("c", list(range(64)))))
        with pytest.raises(InvalidRequest):
            await collect(engine.generate(request("d", [])))
        with pytest.raises(InvalidRequest):
            await collect(engine.generate(request("e", PROMPT, dp_rank=3)))


async def test_duplicate_rid_in_flight_is_refused() -> None:
    async with MockEngine(config()) as engine:
        await engine.pause(PauseMode.IN_PLACE)
        first = engine.generate(request("a", PROMPT))
        with pytest.raises(InvalidRequest):
            await collect(engine.generate(request("a", PROMPT)))
        await first.aclose()


async def test_abort_before_the_first_token_frees_everything() -> None:
    async with MockEngine(config(timing=FAST)) as engine:
        long = [request(f"r{i}", [i, *PROMPT], max_tokens=500) for i in range(3)]
        streams = [engine.generate(r) for r in long]
        queued = engine.generate(request("queued", PROMPT))
        # The queued one may not even be admitted yet: abort it, and a running one.
        await engine.abort("queued")
        outputs = await collect(queued)
        assert tokens_of(outputs) == [] and outputs[-1].finish_reason == "cancelled"
        await anyio.sleep(0.01)
        for s in streams:
            await s.aclose()  # closing early aborts too
        stats = engine.statistics()
        assert stats.used_blocks == 0 and stats.in_flight == 0 and engine.is_quiescent()
        await engine.abort("unknown")  # a no-op


async def test_abort_while_prefilling_and_after_finishing() -> None:
    # A slow prefill: one huge chunk per step at speed-up 1 (~100 ms).
    async with MockEngine(config(timing=TimingModel(speedup=1.0))) as engine:
        stream = engine.generate(request("p", list(range(900)), max_tokens=5))
        await wait_until(lambda: engine.phase_of("p") == "prefill", timeout=5.0)
        await engine.abort("p")
        assert engine.phase_of("p") is None
        assert engine.statistics().used_blocks == 0
        outputs = await collect(stream)
        assert outputs[-1].finish_reason == "cancelled" and tokens_of(outputs) == []


async def test_dropping_an_unfinished_stream_aborts_it() -> None:
    async with MockEngine(config(timing=FAST)) as engine:
        stream = engine.generate(request("x", PROMPT, max_tokens=10_000))
        await stream.__anext__()
        del stream
        gc.collect()
        await wait_until(engine.is_quiescent, timeout=5.0)
        assert engine.statistics().used_blocks == 0


async def test_pause_abort_cancels_everything_in_flight() -> None:
    async with MockEngine(config(timing=FAST)) as engine:
        streams = [
            engine.generate(request(f"r{i}", [i, *PROMPT], max_tokens=10_000)) for i in range(4)
        ]
        await anyio.sleep(0.02)
        await engine.pause(PauseMode.ABORT)
        for s in streams:
            outputs = await collect(s)
            assert outputs[-1].finish_reason == "cancelled"
        assert engine.is_quiescent() and engine.statistics().used_blocks == 0
        # New requests wait while paused and run after continue.
        stream = engine.generate(request("later", PROMPT))
        await anyio.sleep(0.02)
        assert engine.phase_of("later") == "waiting"
        await engine.continue_generation()
        assert len(tokens_of(await collect(stream))) == 8


async def test_pause_retract_requeues_and_resumes_exactly() -> None:
    async with MockEngine(config(timing=FAST)) as engine:
        expected, _ = await run(engine, request("ref", PROMPT, max_tokens=300))
        stream = engine.generate(request("r", PROMPT, max_tokens=300))
        first = await stream.__anext__()
        await engine.pause(PauseMode.RETRACT)
        assert engine.phase_of("r") == "waiting"
        assert engine.statistics().used_blocks == 0  # KV freed (pages stay cached)
        await engine.release_memory([MemoryTag.KV_CACHE])  # possible now
        await engine.resume_memory([MemoryTag.KV_CACHE])
        await engine.continue_generation()
        rest = tokens_of(await collect(stream))
        assert first.token_ids + rest == expected
        assert engine.statistics().ranks[0].retractions == 1


async def test_pause_in_place_keeps_kv_and_continues() -> None:
    async with MockEngine(config(timing=FAST)) as engine:
        expected, _ = await run(engine, request("ref", PROMPT, max_tokens=300))
        stream = engine.generate(request("r", PROMPT, max_tokens=300))
        got = list((await stream.__anext__()).token_ids)
        await engine.pause(PauseMode.IN_PLACE)
        used = engine.statistics().used_blocks
        generated = engine.statistics().generated_tokens
        await anyio.sleep(0.02)
        assert engine.phase_of("r") == "decode" and used > 0
        assert engine.statistics().generated_tokens == generated  # no step ran
        await engine.continue_generation()
        got += tokens_of(await collect(stream))
        assert got == expected


async def test_memory_pressure_retracts_and_output_is_unchanged() -> None:
    # 8 blocks of 16 tokens; 3 requests growing to ~100 tokens each cannot all fit.
    cfg = config(num_blocks=8, max_running_requests=4)
    async with MockEngine(cfg) as engine:
        expected = [
            (await run(engine, request(f"ref{i}", [i, 1, 2, 3], max_tokens=90)))[0]
            for i in range(3)
        ]
        async with anyio.create_task_group() as tg:
            results: dict[int, list[int]] = {}

            async def one(i: int) -> None:
                results[i] = (await run(engine, request(f"r{i}", [i, 1, 2, 3], max_tokens=90)))[0]

            for i in range(3):
                tg.start_soon(one, i)
        assert [results[i] for i in range(3)] == expected
        assert engine.statistics().ranks[0].retractions > 0


async def test_data_parallel_ranks_have_their_own_pools() -> None:
    async with MockEngine(config(dp_size=2)) as engine:
        await run(engine, request("a", PROMPT, dp_rank=1))
        stats = engine.statistics()
        assert stats.ranks[0].pool.cached == 0 and stats.ranks[1].pool.cached > 0
        _, last = await run(engine, request("b", PROMPT, dp_rank=0))
        assert last.usage is not None and last.usage.cached_tokens == 0
        _, last = await run(engine, request("c", PROMPT, dp_rank=1))
        assert last.usage is not None and last.usage.cached_tokens == 32
        # Without a hint the least loaded rank takes it: two concurrent requests spread out.
        await engine.pause(PauseMode.IN_PLACE)
        s1 = engine.generate(request("d", PROMPT))
        s2 = engine.generate(request("e", PROMPT))
        assert {r.waiting for r in engine.statistics().ranks} == {1}
        await engine.continue_generation()
        await collect(s1)
        await collect(s2)


async def test_flush_cache_only_when_idle() -> None:
    async with MockEngine(config()) as engine:
        await run(engine, request("a", PROMPT))
        assert engine.statistics().ranks[0].pool.cached > 0
        stream = engine.generate(request("b", PROMPT, max_tokens=10_000))
        await stream.__anext__()
        await engine.pause(PauseMode.IN_PLACE)
        assert not await engine.flush_cache()  # a request holds KV
        await stream.aclose()
        await engine.continue_generation()
        assert await engine.flush_cache()
        assert engine.statistics().ranks[0].pool.cached == 0


async def test_health_payload_runs() -> None:
    async with MockEngine(config()) as engine:
        payload = engine.health_payload()
        assert payload.stop_conditions.max_tokens == 1 and payload.bootstrap_info is None
        tokens, last = await run(engine, payload)
        assert len(tokens) == 1 and last.finish_reason in ("length", "stop")
    async with MockEngine(config(role="prefill", bootstrap_port=7000)) as prefill:
        payload = prefill.health_payload()
        assert payload.bootstrap_info is not None and payload.health_check
        assert payload.bootstrap_info.host == "2.2.2.2"
        tokens, _ = await run(prefill, payload)
        assert len(tokens) == 1 and prefill.is_quiescent()  # the fake host owes no transfer


async def test_cleanup_is_idempotent_and_runs_once() -> None:
    async with anyio.create_task_group() as tg:
        engine = MockEngine(config(timing=FAST), task_group=tg)
        await engine.start()
        stream = engine.generate(request("a", PROMPT, max_tokens=10_000))
        await stream.__anext__()
        async with anyio.create_task_group() as cleaners:
            for _ in range(3):
                cleaners.start_soon(engine.cleanup)
        await engine.cleanup()
        assert engine.cleanup_runs == 1
        with pytest.raises(EngineShutdown):
            while True:
                await stream.__anext__()
        with pytest.raises(EngineShutdown):
            await collect(engine.generate(request("b", PROMPT)))


async def test_cleanup_without_start_and_start_needs_a_task_group() -> None:
    engine = MockEngine(config())
    with pytest.raises(RuntimeError):
        await engine.start()
    await engine.cleanup()
    await engine.cleanup()
    assert engine.cleanup_runs == 1


async def test_runs_in_the_callers_task_group_and_leaves_no_task() -> None:
    async with anyio.create_task_group() as tg:
        engine = MockEngine(config(dp_size=2), task_group=tg)
        await engine.start()
        tokens, _ = await run(engine, request("a", PROMPT))
        assert len(tokens) == 8
        await engine.cleanup()
    # The task group exits only because the engine's tasks are gone.
