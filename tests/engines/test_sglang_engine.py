"""The SGLang engine backend against fakes of SGLang built from each signature record.

See tests/engines/_sglang_fakes.py for how the fakes follow the record.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from actors.serving.engines._sglang import SGLangEngine, SGLangRequiresAsyncio
from actors.serving.engines._sglang._signals import DeferredSignalHandlers
from actors.testing import wait_until
from protocols.engine import (
    BootstrapInfo,
    EngineOutput,
    MemoryTag,
    PauseMode,
    PreprocessedRequest,
    RoutingHints,
    SamplingOptions,
    TokenLogprob,
)
from protocols.errors import (
    EngineFailure,
    EngineShutdown,
    InvalidRequest,
    WorkerDraining,
)
from tests.engines._sglang_fakes import (
    BOOT,
    FakeSGLang,
    Record,
    collect,
    request,
    running,
)

# ------------------------------------------------------------------------------------------
# (a) The contract, driven through fakes built from the record
# ------------------------------------------------------------------------------------------


async def test_start_forces_settings_and_reports_capacity(
    anyio_backend: str, fake: FakeSGLang
) -> None:
    async with running(anyio_backend, fake, kv_events=True) as engine:
        if engine is None:
            return
        (init,) = fake.args_of("Engine.__init__")
        kwargs = init["kwargs"]
        assert kwargs["model_path"] == "/models/tiny"  # the operator's args pass through
        assert kwargs["skip_tokenizer_init"] is True
        assert kwargs["incremental_streaming_output"] is True
        assert kwargs["disaggregation_mode"] == "null"
        assert kwargs["enable_metrics"] is True
        cfg = json.loads(kwargs["kv_events_config"])
        if "bind" in fake.record.fields("KVEventsConfig"):  # told to bind a loopback port
            assert cfg["bind"] is True and cfg["endpoint"].startswith("tcp://127.0.0.1:")
        else:  # SGLang binds only ipc (or a wildcard): a private ipc path
            assert "bind" not in cfg and cfg["endpoint"].startswith("ipc://")
        # The launch ran in a worker thread; SGLang's handle loop was bound to this loop.
        assert fake.init_threads[0] is not threading.main_thread()
        assert fake.engines[0].tokenizer_manager.event_loop is asyncio.get_running_loop()
        cap = engine.capacity
        assert cap is not None
        assert (cap.total_kv_blocks, cap.block_size) == (65536 // 16, 16)
        assert (cap.max_running_requests, cap.max_batch_tokens, cap.context_length) == (
            48,
            8192,
            4096,
        )
        assert cap.dp_size == 1 and cap.bootstrap is None
        assert cap.kv_events_endpoints == (cfg["endpoint"],)
        assert cap.kv_events_replay_endpoints == ()
        assert cap.metrics_endpoint == f"ipc://{fake.tmp}/metrics"
        info = await engine.server_info()
        assert info["max_total_num_tokens"] == 65536
        with pytest.raises(RuntimeError, match="once"):
            await engine.start()


async def test_generate_aggregated(anyio_backend: str, fake: FakeSGLang) -> None:
    fake.internal_state["dp_size"] = (
        2  # the record's routed_dp_rank is used, never the deprecated one
    )
    async with running(anyio_backend, fake, warmup=False) as engine:
        if engine is None:
            return
        req = request(
            n=3,
            sampling_options=SamplingOptions(temperature=0.5, top_k=5, seed=7),
            routing=RoutingHints(dp_rank=1, priority=3),
        )
        outs = await collect(engine.generate(req))
        assert [o.token_ids for o in outs] == [[100], [101], [102]]  # the idle tick is skipped
        assert [o.finish_reason for o in outs] == [None, None, "length"]
        usage = outs[-1].usage
        assert usage is not None and (
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.cached_tokens,
        ) == (3, 3, 3)
        (call,) = fake.args_of("Engine.async_generate")
        assert call["input_ids"] == [1, 2, 3] and call["rid"] == "r1" and call["stream"] is True
        assert call["sampling_params"] == {
            "max_new_tokens": 3,
            "temperature": 0.5,
            "top_k": 5,
            "sampling_seed": 7,
        }
        assert call["routed_dp_rank"] == 1 and "data_parallel_rank" not in call
        assert call["priority"] == 3
        assert "bootstrap_host" not in call
        assert engine.is_quiescent()
        # Aborts the client did not ask for are typed errors, never "cancelled"; the tokens of
        # that last chunk still reach the client first.
        seen: list[EngineOutput] = []
        with pytest.raises(InvalidRequest, match="too long"):
            await collect(engine.generate(PreprocessedRequest(rid="b", token_ids=[666])), seen)
        assert [o.token_ids for o in seen] == [[5]]
        with pytest.raises(EngineFailure, match="scheduler error") as failed:
            await collect(engine.generate(PreprocessedRequest(rid="bad", token_ids=[777])))
        assert failed.value.migratable


async def test_a_release_without_routed_dp_rank_gets_data_parallel_rank(
    anyio_backend: str, record: Record, tmp_path: Path
) -> None:
    # The record as an SGLang that predates routed_dp_rank would have it.
    older = Record(record.path)
    params = older.data["callables"]["Engine.async_generate"]["params"]
    params[:] = [p for p in params if p["name"] != "routed_dp_rank"]
    fake = FakeSGLang(tmp_path, older)
    fake.internal_state["dp_size"] = 2
    async with running(anyio_backend, fake, warmup=False) as engine:
        if engine is None:
            return
        await collect(engine.generate(request(n=1, routing=RoutingHints(dp_rank=1))))
        (call,) = fake.args_of("Engine.async_generate")
        assert call["data_parallel_rank"] == 1 and "routed_dp_rank" not in call


async def test_logprobs_map_from_meta_info(anyio_backend: str, fake: FakeSGLang) -> None:
    async with running(anyio_backend, fake, warmup=False) as engine:
        if engine is None:
            return
        outs = await collect(engine.generate(request(n=3, logprobs=2)))
        # SGLang's lists run from the first token on: each output takes its new tokens' tail.
        assert [o.logprobs for o in outs] == [
            [TokenLogprob(-0.5 * (i + 1), [100 + i, 101 + i], [-0.5 * (i + 1), -0.5 * (i + 1) - 1])]
            for i in range(3)
        ]
        await collect(engine.generate(request("plain", n=2)))
        wanted, plain = fake.args_of("Engine.async_generate")
        assert (wanted["return_logprob"], wanted["top_logprobs_num"]) == (True, 2)
        assert "return_logprob" not in plain


async def test_prompt_logprobs_map_from_meta_info(anyio_backend: str, fake: FakeSGLang) -> None:
    async with running(anyio_backend, fake, warmup=False) as engine:
        if engine is None:
            return
        outs = await collect(engine.generate(request(n=3, logprobs=1, prompt_logprobs=2)))
        # The prompt [1, 2, 3]: one entry per token after the first, on the first output only.
        assert outs[0].prompt_logprobs == [
            TokenLogprob(-0.25, [2, 3], [-0.25, -1.25]),
            TokenLogprob(-0.5, [3, 4], [-0.5, -1.5]),
        ]
        assert all(o.prompt_logprobs is None for o in outs[1:])
        # SGLang's one top-k serves both: the output's alternatives are cut to what it asked.
        assert all(len(lp.top_ids) == 1 for o in outs for lp in o.logprobs or ())
        (wanted,) = fake.args_of("Engine.async_generate")
        assert (wanted["logprob_start_len"], wanted["top_logprobs_num"]) == (0, 2)


@pytest.mark.parametrize("role", ["aggregated", "decode"])
async def test_every_role_warms_up_before_it_is_ready(
    anyio_backend: str, fake: FakeSGLang, role: str
) -> None:
    # Kernels compile on the warm-up, not on the first client request (which would stall).
    async with running(anyio_backend, fake, role=role) as engine:
        if engine is None:
            return
        (warm,) = fake.args_of("Engine.async_generate")
        assert warm["rid"].startswith("warmup-") and warm["stream"] is True
        if role == "decode":  # SGLang's fake bootstrap host: no KV transfer to wait for
            assert warm["bootstrap_host"] == fake.record.fake_host
        else:
            assert "bootstrap_host" not in warm
        assert engine.is_quiescent()


async def test_generate_prefill_registers_the_room_before_handing_it_out(
    anyio_backend: str, fake: FakeSGLang
) -> None:
    async with running(anyio_backend, fake, role="prefill") as engine:
        if engine is None:
            return
        # The warm-up ran at start, with SGLang's fake bootstrap host, and was drained.
        (warm,) = fake.args_of("Engine.async_generate")
        port = engine.bootstrap_port
        assert warm["bootstrap_host"] == fake.record.fake_host and warm["bootstrap_port"] == port
        cap = engine.capacity
        assert cap is not None and cap.bootstrap == BootstrapInfo(
            host="127.0.0.1", port=port, room=0
        )
        (init,) = fake.args_of("Engine.__init__")
        assert init["kwargs"]["disaggregation_mode"] == "prefill"
        assert init["kwargs"]["disaggregation_transfer_backend"] == "nixl"
        fake.hold_transfer = anyio.Event()
        stream = engine.generate(request("p1", bootstrap_info=BOOT))
        first = await stream.__anext__()
        assert first.disaggregated_params == BOOT and first.token_ids == []
        assert fake.rooms[-1] == 42  # registered (dispatched) before the triple was handed out
        assert not engine.is_quiescent()  # the KV transfer is still owed
        fake.hold_transfer.set()
        rest = await collect(stream)
        assert len(rest) == 1 and rest[0].finish_reason == "length" and rest[0].token_ids == []
        assert engine.is_quiescent()
        # Without a router-chosen triple: this worker's endpoint and a fresh room.
        outs = await collect(engine.generate(request("p2")))
        params = outs[0].disaggregated_params
        assert params is not None and params.host == "127.0.0.1" and params.room == fake.rooms[-1]


async def test_generate_decode_needs_the_bootstrap_triple(
    anyio_backend: str, fake: FakeSGLang
) -> None:
    async with running(anyio_backend, fake, role="decode") as engine:
        if engine is None:
            return
        with pytest.raises(InvalidRequest, match="bootstrap_info"):
            await collect(engine.generate(request("d0")))
        outs = await collect(engine.generate(request("d1", n=2, bootstrap_info=BOOT)))
        assert [o.token_ids for o in outs] == [[100], [101]]
        call = fake.args_of("Engine.async_generate")[-1]
        assert (call["bootstrap_host"], call["bootstrap_port"], call["bootstrap_room"]) == (
            "10.0.0.9",
            9000,
            42,
        )


async def test_abort_before_the_first_token(anyio_backend: str, fake: FakeSGLang) -> None:
    async with running(anyio_backend, fake, warmup=False) as engine:
        if engine is None:
            return
        # 1. Before its generate began: it ends at once and never reaches SGLang.
        await engine.abort("early")
        outs = await collect(engine.generate(request("early")))
        assert [o.finish_reason for o in outs] == ["cancelled"]
        assert not fake.args_of("Engine.async_generate")
        # An abort arriving after its request finished is not held against a later reuse.
        await collect(engine.generate(request("done", n=1)))
        await engine.abort("done")
        outs = await collect(engine.generate(request("done", n=1)))
        assert [o.finish_reason for o in outs] == ["length"]
        fake.calls.clear()
        # 2. Dispatched, no token yet: SGLang's abort_request with our rid, then a cancelled end.
        fake.hold_first_token = anyio.Event()
        async with anyio.create_task_group() as tg:
            results: list[EngineOutput] = []

            async def consume() -> None:
                results.extend(await collect(engine.generate(request("held"))))

            tg.start_soon(consume)
            tm = fake.engines[0].tokenizer_manager
            await wait_until(
                lambda: "held" in tm.rid_to_state and tm.rid_to_state["held"].dispatched, timeout=5
            )
            await engine.abort("held")
        assert [o.finish_reason for o in results] == ["cancelled"]
        assert {"rid": "held"} in fake.args_of("TokenizerManager.abort_request")
        assert fake.aborted_in_scheduler() == ["held"] and "held" not in tm.rid_to_state
        # 3. Not dispatched yet (held in SGLang's tokenizer): interrupted, nothing sent or lost.
        fake.hold_first_token = None
        fake.hold_dispatch = anyio.Event()
        async with anyio.create_task_group() as tg:
            results.clear()
            tg.start_soon(consume)
            await wait_until(lambda: "held" in tm.rid_to_state, timeout=5)
            await engine.abort("held")
        assert [o.finish_reason for o in results] == ["cancelled"]
        assert fake.lost_aborts == [] and fake.aborted_in_scheduler() == ["held"]
        assert not tm.rid_to_state
        assert engine.is_quiescent()


async def test_closing_the_stream_early_aborts_it(anyio_backend: str, fake: FakeSGLang) -> None:
    async with running(anyio_backend, fake) as engine:
        if engine is None:
            return
        stream = engine.generate(request("c1", n=10))
        first = await stream.__anext__()
        assert first.token_ids == [100]
        await stream.aclose()  # type: ignore[attr-defined]
        assert fake.args_of("TokenizerManager.abort_request") == [{"rid": "c1"}]
        assert fake.aborted_in_scheduler() == ["c1"]
        tm = fake.engines[0].tokenizer_manager
        assert not tm.rid_to_state and engine.is_quiescent()
        # A consumer cancelled while it waits for the first token: SGLang's step is cancelled
        # with it, and the dispatched request is aborted in the scheduler.
        fake.hold_first_token = anyio.Event()
        with anyio.move_on_after(5) as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(collect, engine.generate(request("c2")))
                await wait_until(
                    lambda: "c2" in tm.rid_to_state and tm.rid_to_state["c2"].dispatched, timeout=5
                )
                tg.cancel_scope.cancel()
        assert not scope.cancelled_caught
        assert fake.aborted_in_scheduler() == ["c1", "c2"] and engine.is_quiescent()


async def test_closing_a_prefill_stream_after_the_bootstrap_aborts_it(
    anyio_backend: str, fake: FakeSGLang
) -> None:
    async with running(anyio_backend, fake, role="prefill", warmup=False) as engine:
        if engine is None:
            return
        assert not fake.args_of("Engine.async_generate")  # no warm-up asked for
        fake.hold_transfer = anyio.Event()
        stream = engine.generate(request("p", bootstrap_info=BOOT))
        first = await stream.__anext__()
        assert first.disaggregated_params == BOOT
        await stream.aclose()  # type: ignore[attr-defined]
        assert fake.args_of("TokenizerManager.abort_request") == [{"rid": "p"}]
        assert fake.aborted_in_scheduler() == ["p"] and engine.is_quiescent()


async def test_pause_modes(anyio_backend: str, fake: FakeSGLang) -> None:
    async with running(anyio_backend, fake) as engine:
        if engine is None:
            return
        for mode in (PauseMode.RETRACT, PauseMode.IN_PLACE):
            await engine.pause(mode)
            await engine.continue_generation()
        # An abort-mode pause aborts in-flight requests: they fail as draining (migratable),
        # never as "cancelled" (Dynamo PR #13952's truncated answers).
        fake.hold_first_token = anyio.Event()
        errors: list[BaseException] = []

        async def consume() -> None:
            try:
                await collect(engine.generate(request("p")))
            except WorkerDraining as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            tm = fake.engines[0].tokenizer_manager
            await wait_until(
                lambda: "p" in tm.rid_to_state and tm.rid_to_state["p"].dispatched, timeout=5
            )
            await engine.pause(PauseMode.ABORT)
        assert len(errors) == 1 and errors[0].migratable
        assert [a["obj"].mode for a in fake.args_of("TokenizerManager.pause_generation")] == [
            "retract",
            "in_place",
            "abort",
        ]
        assert engine.statistics().paused == "abort"
        await engine.continue_generation()
        assert len(fake.args_of("TokenizerManager.continue_generation")) == 3
        assert engine.statistics().paused is None


async def test_pause_abort_of_a_request_not_yet_dispatched(
    anyio_backend: str, fake: FakeSGLang
) -> None:
    """SGLang 0.5.17's abort-mode pause flags the requests it has not dispatched yet, and each
    then fails with its RequestAbortedError (a ValueError): it must end as an abort (draining,
    migratable), never as the client's invalid request. Newer SGLang leaves such a request
    waiting; it runs once generation continues."""
    async with running(anyio_backend, fake) as engine:
        if engine is None:
            return
        fails_early = fake.record.RequestAbortedError is not None
        fake.hold_dispatch = anyio.Event()
        results: list[EngineOutput] = []
        errors: list[WorkerDraining] = []

        async def consume() -> None:
            try:
                await collect(engine.generate(request("q", n=2)), results)
            except WorkerDraining as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await wait_until(lambda: "q" in fake.held_before_dispatch, timeout=5)
            await engine.pause(PauseMode.ABORT)
            fake.hold_dispatch.set()
            if fails_early:
                await wait_until(lambda: bool(errors), timeout=5)  # while still paused
            await engine.continue_generation()
        if fails_early:
            assert len(errors) == 1 and errors[0].migratable and results == []
        else:
            assert errors == [] and [o.finish_reason for o in results] == [None, "length"]
        tm = fake.engines[0].tokenizer_manager
        assert fake.scheduler_aborts == [] and not tm.rid_to_state and engine.is_quiescent()


async def test_kv_events_for_several_dp_ranks(anyio_backend: str, fake: FakeSGLang) -> None:
    """One loopback tcp port per DP rank where SGLang can be told to bind one; where it cannot
    (no ``KVEventsConfig.bind``), a clear error at start, before SGLang is launched."""
    server_args = {"model_path": "/models/tiny", "dp_size": 2}
    if anyio_backend == "trio" or "bind" in fake.record.fields("KVEventsConfig"):
        fake.internal_state["dp_size"] = 2
        async with running(anyio_backend, fake, server_args=server_args, kv_events=True) as eng:
            if eng is None:
                return
            assert eng.capacity is not None
            endpoints = eng.capacity.kv_events_endpoints
            assert len(endpoints) == 2 and all(e.startswith("tcp://127.0.0.1:") for e in endpoints)
        return
    engine = SGLangEngine(server_args, api=fake.api(), kv_events=True)
    with pytest.raises(ValueError, match="dp_size > 1"):
        await engine.start()
    await engine.cleanup()
    assert fake.engines == []


async def test_release_and_resume_memory(anyio_backend: str, fake: FakeSGLang) -> None:
    async with running(anyio_backend, fake, memory_release=True) as engine:
        if engine is None:
            return
        (init,) = fake.args_of("Engine.__init__")
        assert init["kwargs"]["enable_memory_saver"] is True
        with pytest.raises(RuntimeError, match="pause"):
            await engine.release_memory([MemoryTag.KV_CACHE])
        await engine.pause(PauseMode.RETRACT)
        await engine.release_memory([MemoryTag.WEIGHTS, MemoryTag.KV_CACHE])
        await engine.release_memory([MemoryTag.KV_CACHE])  # already released: no SGLang call
        released = fake.args_of("TokenizerManager.release_memory_occupation")
        assert [a["obj"].tags for a in released] == [["kv_cache", "weights"]]
        assert released[0]["request"] is None
        with pytest.raises(WorkerDraining):
            await collect(engine.generate(request("x")))
        await engine.resume_memory([MemoryTag.WEIGHTS])  # partial
        with pytest.raises(RuntimeError, match="kv_cache"):
            await engine.continue_generation()
        # Unreleased tags never reach SGLang (its KeyError would crash the scheduler).
        await engine.resume_memory([MemoryTag.WEIGHTS, MemoryTag.CUDA_GRAPH])
        await engine.resume_memory([])
        await engine.resume_memory([MemoryTag.KV_CACHE, MemoryTag.CUDA_GRAPH])
        resumed = fake.args_of("TokenizerManager.resume_memory_occupation")
        assert [a["obj"].tags for a in resumed] == [["weights"], ["kv_cache"]]
        await engine.continue_generation()
        assert engine.released_tags() == frozenset()
        outs = await collect(engine.generate(request("y", n=1)))
        assert outs[-1].finish_reason == "length"


async def test_release_waits_for_sglang_to_let_aborted_requests_go(
    anyio_backend: str, fake: FakeSGLang, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with running(anyio_backend, fake, memory_release=True) as engine:
        if engine is None:
            return
        registry = fake.engines[0].tokenizer_manager.rid_to_state
        await engine.pause(PauseMode.RETRACT)
        # An aborted request SGLang has not let go yet: the release waits for it.
        registry["leaving"] = object()

        async def let_go() -> None:
            await anyio.sleep(0.1)
            del registry["leaving"]

        async with anyio.create_task_group() as tg:
            tg.start_soon(let_go)
            await engine.release_memory([MemoryTag.KV_CACHE])
        assert engine.released_tags() == {MemoryTag.KV_CACHE}
        # One that never goes: a typed failure (the lifecycle rolls back), SGLang never asked.
        monkeypatch.setattr("actors.serving.engines._sglang._engine._RELEASE_IDLE_WAIT_S", 0.1)
        registry["stuck"] = object()
        with pytest.raises(EngineFailure, match="still holds 1 requests"):
            await engine.release_memory([MemoryTag.WEIGHTS])
        del registry["stuck"]
        assert len(fake.args_of("TokenizerManager.release_memory_occupation")) == 1


async def test_release_needs_the_memory_saver(anyio_backend: str, fake: FakeSGLang) -> None:
    async with running(anyio_backend, fake) as engine:
        if engine is None:
            return
        await engine.pause(PauseMode.ABORT)
        with pytest.raises(RuntimeError, match="memory_release"):
            await engine.release_memory([MemoryTag.WEIGHTS])
        assert not fake.args_of("TokenizerManager.release_memory_occupation")


async def test_flush_cache(anyio_backend: str, fake: FakeSGLang) -> None:
    async with running(anyio_backend, fake) as engine:
        if engine is None:
            return
        assert await engine.flush_cache() is True
        fake.engines[0].tokenizer_manager.rid_to_state["busy"] = fake.state()
        assert await engine.flush_cache() is False
        del fake.engines[0].tokenizer_manager.rid_to_state["busy"]


async def test_health_payloads(anyio_backend: str, fake: FakeSGLang) -> None:
    async with running(anyio_backend, fake, bos_token_id=128000) as engine:
        if engine is None:
            return
        canary = engine.health_payload()
        assert canary.token_ids == [128000] and canary.health_check
        assert canary.stop_conditions.max_tokens == 1 and canary.bootstrap_info is None
        assert canary.sampling_options.temperature == 0.0 and canary.sampling_options.top_k == -1
        assert canary.rid != engine.health_payload().rid
        outs = await collect(engine.generate(canary))
        assert outs[-1].finish_reason == "length"
    async with running(anyio_backend, fake, role="decode") as engine:
        if engine is None:
            return
        canary = engine.health_payload()
        assert canary.token_ids == [1]
        assert canary.bootstrap_info == BootstrapInfo(
            host=fake.record.fake_host, port=engine.bootstrap_port, room=0
        )
        outs = await collect(engine.generate(canary))
        assert outs[-1].finish_reason == "length"


async def test_cleanup_runs_exactly_once(
    anyio_backend: str, fake: FakeSGLang, monkeypatch: pytest.MonkeyPatch
) -> None:
    unregistered: list[Any] = []
    unregister = atexit.unregister

    def recording_unregister(func: Callable[..., Any]) -> None:
        unregistered.append(func)
        unregister(func)

    monkeypatch.setattr(atexit, "unregister", recording_unregister)
    engine = SGLangEngine({"model_path": "m"}, api=fake.api())
    if anyio_backend == "trio":
        with pytest.raises(SGLangRequiresAsyncio):
            await engine.start()
        await engine.cleanup()
        await engine.cleanup()
        assert engine.statistics().closed
        return
    await engine.start()
    tm = fake.engines[0].tokenizer_manager
    sglang_tasks = list(tm.asyncio_tasks)
    own_loop = fake.engines[0].loop
    fake.hold_first_token = anyio.Event()
    errors: list[BaseException] = []

    async def consume() -> None:
        try:
            await collect(engine.generate(request("inflight")))
        except EngineShutdown as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await wait_until(
            lambda: "inflight" in tm.rid_to_state and tm.rid_to_state["inflight"].dispatched,
            timeout=5,
        )
        tg.start_soon(engine.cleanup)
        tg.start_soon(engine.cleanup)
    await engine.cleanup()
    asyncio.get_running_loop().remove_signal_handler(signal.SIGQUIT)
    assert len(errors) == 1 and errors[0].migratable  # a request cut by shutdown can migrate
    assert len(fake.args_of("Engine.shutdown")) == 1
    assert fake.shutdown_threads[0] is not threading.main_thread()  # never on the event loop
    assert unregistered == [fake.engines[0].shutdown]  # SGLang's atexit hook is gone
    assert all(t.done() for t in sglang_tasks)  # SGLang's own tasks end with the engine
    assert own_loop.is_closed()
    assert engine.statistics().closed
    with pytest.raises(EngineShutdown):
        await collect(engine.generate(request("late")))


async def test_sglang_signal_handlers_are_deferred(anyio_backend: str, fake: FakeSGLang) -> None:
    if anyio_backend == "trio":
        async with running(anyio_backend, fake) as engine:
            assert engine is None
        return
    loop = asyncio.get_running_loop()
    ours = anyio.Event()
    loop.add_signal_handler(signal.SIGTERM, ours.set)  # the lifecycle's handler
    try:
        engine = SGLangEngine({"model_path": "m"}, api=fake.api())
        try:
            await engine.start()
            tm = fake.engines[0].tokenizer_manager
            assert engine.statistics().deferred_signals == {int(signal.SIGTERM): 1}
            os.kill(os.getpid(), signal.SIGTERM)
            with anyio.fail_after(5):
                await ours.wait()  # ours still owns SIGTERM ...
            assert not tm.gracefully_exit  # ... and SGLang's handler did not run
            engine.note_shutdown_signal(signal.SIGTERM)
        finally:
            await engine.cleanup()
            loop.remove_signal_handler(signal.SIGQUIT)  # passed through to the loop
        assert tm.gracefully_exit  # the deferred handler ran at cleanup, after SGLang's tasks ended
        assert "add_signal_handler" not in vars(loop)
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def test_deferred_signal_handlers_unit() -> None:
    """Capture on a loop of its own (the capture shadows an asyncio loop's method)."""
    loop = asyncio.new_event_loop()
    try:
        _deferred_signal_handlers_on(loop)
    finally:
        loop.close()


def _deferred_signal_handlers_on(loop: asyncio.AbstractEventLoop) -> None:
    calls: list[str] = []

    async def coro_handler() -> None:
        calls.append("coro")

    def failing() -> None:
        calls.append("fail")
        raise RuntimeError("boom")

    signals = DeferredSignalHandlers(loop)
    signals.install()
    signals.install()
    try:
        loop.add_signal_handler(signal.SIGINT, coro_handler)
        loop.add_signal_handler(signal.SIGINT, failing)
        loop.add_signal_handler(signal.SIGTERM, calls.append, "term")
        assert signals.captured() == {int(signal.SIGINT): 2, int(signal.SIGTERM): 1}
    finally:
        signals.uninstall()
        signals.uninstall()
    assert "add_signal_handler" not in vars(loop) and not signals.installed
    assert loop.run_until_complete(signals.run_deferred(signal.SIGINT)) == 2
    assert calls == ["coro", "fail"]
    assert loop.run_until_complete(signals.run_deferred()) == 1 and calls[-1] == "term"
    assert loop.run_until_complete(signals.run_deferred()) == 0
