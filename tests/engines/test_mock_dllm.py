"""The mock as a block-diffusion model (``kind="dllm"``): its text comes out in blocks of
``dllm_block_tokens`` tokens, one block per output, the last one cut where the request ends; the
tokens are the chat mock's, so a continuation after whole blocks goes on exactly; a request that
ends otherwise drops its unfinished block; the injected empty output comes once, on a first
attempt only."""

from __future__ import annotations

import msgspec
import pytest

from actors.serving.engines import MockEngine, TimingModel
from actors.serving.engines._mock._dllm import step_seconds
from protocols.engine import EngineOutput
from tests.engines._mock_helpers import FAST, collect, config, request, run, tokens_of

PROMPT = list(range(200, 237))  # 37 tokens
BLOCK = 8

# Timed steps and instant ones: a reader that keeps up, and one that finds several blocks ready.
both_timings = pytest.mark.parametrize(
    "timing", [FAST, TimingModel(instant=True)], ids=["timed", "instant"]
)


def _sizes(outputs: list[EngineOutput]) -> list[int]:
    return [len(o.token_ids) for o in outputs]


@both_timings
async def test_blocks_of_the_configured_size_with_the_chat_text(timing: TimingModel) -> None:
    async with (
        MockEngine(config(timing=timing)) as chat,
        MockEngine(config(timing=timing, kind="dllm", dllm_block_tokens=BLOCK)) as dllm,
    ):
        for seed, temperature in ((7, None), (None, 0.0)):
            req = request("a", PROMPT, max_tokens=30, seed=seed, temperature=temperature)
            expected, _ = await run(chat, req)
            outputs = await collect(dllm.generate(req))
            assert _sizes(outputs) == [8, 8, 8, 6]  # the last block cut by max_tokens
            assert tokens_of(outputs) == expected
            assert all(o.finish_reason is None and o.usage is None for o in outputs[:-1])
            last = outputs[-1]
            assert last.finish_reason == "length" and last.usage is not None
            assert last.usage.completion_tokens == 30
        # A whole number of blocks: the last one, whole, carries the finish.
        outputs = await collect(dllm.generate(request("b", PROMPT, max_tokens=16)))
        assert _sizes(outputs) == [8, 8] and outputs[-1].finish_reason == "length"


@both_timings
async def test_a_stop_token_cuts_its_block(timing: TimingModel) -> None:
    async with (
        MockEngine(config(timing=timing)) as chat,
        MockEngine(config(timing=timing, kind="dllm", dllm_block_tokens=BLOCK)) as dllm,
    ):
        base, _ = await run(chat, request("a", PROMPT, max_tokens=20))
        at = 11
        stop = base[at]
        cut = base.index(stop)  # its first place (the mock's tokens rarely repeat)
        outputs = await collect(
            dllm.generate(request("b", PROMPT, max_tokens=20, stop_token_ids=[stop]))
        )
        assert tokens_of(outputs) == base[: cut + 1]  # the stop token included, as SGLang's
        sizes = [BLOCK] * ((cut + 1) // BLOCK) + ([(cut + 1) % BLOCK] if (cut + 1) % BLOCK else [])
        assert _sizes(outputs) == sizes
        assert outputs[-1].finish_reason == "stop"


@both_timings
async def test_a_continuation_after_whole_blocks_goes_on_exactly(timing: TimingModel) -> None:
    cfg = config(timing=timing, kind="dllm", dllm_block_tokens=BLOCK)
    async with MockEngine(cfg) as engine:
        full, _ = await run(engine, request("a", PROMPT, max_tokens=40, seed=3))
        for k in (8, 16, 32):
            rest = msgspec.structs.replace(
                request(f"k{k}", PROMPT + full[:k], max_tokens=40 - k, seed=3), generated=k
            )
            outputs = await collect(engine.generate(rest))
            assert tokens_of(outputs) == full[k:]
            # The blocks line up with the first attempt's: whole ones, then the cut one.
            assert all(n == BLOCK for n in _sizes(outputs))


@both_timings
async def test_the_injected_empty_output_comes_once_on_a_first_attempt(
    timing: TimingModel,
) -> None:
    async with (
        MockEngine(config(timing=timing, kind="dllm")) as clean,
        MockEngine(config(timing=timing, kind="dllm", dllm_empty_chunk_after=2)) as faulty,
    ):
        expected, _ = await run(clean, request("a", PROMPT, max_tokens=30))
        outputs = await collect(faulty.generate(request("b", PROMPT, max_tokens=30)))
        assert _sizes(outputs) == [8, 8, 0, 8, 6]
        empty = outputs[2]
        assert empty.finish_reason is None and empty == EngineOutput()
        assert tokens_of(outputs) == expected
        # A continuation (generated > 0) gets none: its retry succeeds.
        rest = msgspec.structs.replace(
            request("c", PROMPT + expected[:8], max_tokens=22), generated=8
        )
        outputs = await collect(faulty.generate(rest))
        assert _sizes(outputs) == [8, 8, 6] and tokens_of(outputs) == expected[8:]
        # A request that ends before that many blocks never sees it.
        outputs = await collect(faulty.generate(request("d", PROMPT, max_tokens=12)))
        assert _sizes(outputs) == [8, 4]


@both_timings
async def test_a_chat_engine_ignores_the_block_settings(timing: TimingModel) -> None:
    cfg = config(timing=timing, dllm_block_tokens=BLOCK, dllm_empty_chunk_after=1)
    async with MockEngine(cfg) as engine:
        outputs = await collect(engine.generate(request("a", PROMPT, max_tokens=30)))
        assert all(o.token_ids for o in outputs) and len(tokens_of(outputs)) == 30
        if not timing.instant:
            assert len(outputs) > 4  # timed steps: tokens arrive as they are made


async def test_an_aborted_request_drops_its_unfinished_block() -> None:
    async with MockEngine(config(timing=TimingModel(), kind="dllm")) as engine:
        stream = engine.generate(request("a", PROMPT, max_tokens=2000))
        first = await stream.__anext__()
        assert len(first.token_ids) == BLOCK
        await engine.abort("a")
        rest = await collect(stream)
        assert rest[-1].finish_reason == "cancelled"
        assert all(n % BLOCK == 0 for n in _sizes(rest))


def test_a_block_costs_its_rounds_of_decode_passes() -> None:
    timing = TimingModel()
    chat = config(timing=timing)
    dllm = config(timing=timing, kind="dllm", dllm_block_tokens=8, dllm_rounds=4)
    decode = timing.step_seconds(0, True, 0.25)
    # One token per request per step: a block of 8 takes 8 steps, 4 decode passes in all.
    assert step_seconds(dllm, 0, True, 0.25) == pytest.approx(decode * 4 / 8)
    assert step_seconds(chat, 0, True, 0.25) == decode
    prefill = timing.step_seconds(100, False, 0.25)
    assert step_seconds(dllm, 100, False, 0.25) == prefill  # the prompt's pass is the same
    assert step_seconds(dllm, 100, True, 0.25) == pytest.approx(prefill + decode / 2)


@pytest.mark.parametrize(
    "bad", [{"dllm_block_tokens": 0}, {"dllm_rounds": 0}, {"dllm_empty_chunk_after": 0}]
)
def test_bad_block_settings_are_refused(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        config(kind="dllm", **bad)
