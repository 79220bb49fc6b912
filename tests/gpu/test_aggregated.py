"""Two aggregated SGLang engines on one GPU under one tree: the OpenAI API through the `openai`
client, aborts that reach SGLang, health canaries judged on the real engine, KV-aware routing fed
by SGLang's real KV events, its scheduler load metrics reaching the publisher and the router, and
a SIGKILL mid-stream migrated token for token."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import openai
import pytest

from actors.serving.worker._health import CANARIES
from actors.telemetry import REGISTRY
from actors.testing import wait_until
from tests.gpu.conftest import MODEL, openai_client, sglang_args, sigkill, stream_all
from tests.helpers.serving import Tree, serving_tree

WORKERS = ["decode-0", "decode-1"]


@pytest.fixture(scope="module")
async def tree() -> AsyncIterator[Tree]:
    async with serving_tree(
        ready_timeout=900,
        backend="sglang",
        mode="aggregated",
        decode_workers=2,
        router="kv_aware",
        kv_events=True,
        tokenizer=str(MODEL),
        health_idle_after=1.0,
        health_timeout=30.0,
        stall_timeout=120.0,
        # Batch-invariant kernels: a migrated request re-prefilled elsewhere picks the tokens
        # the first engine would have picked.
        engine_args=sglang_args(0.3, enable_deterministic_inference=True),
    ) as tree:
        yield tree


async def test_completions_and_chat_streaming_and_not(tree: Tree) -> None:
    async with openai_client(tree) as client:
        model = (await client.models.list()).data[0].id
        whole = await client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=24, temperature=0
        )
        choice = whole.choices[0]
        assert choice.finish_reason == "length" and choice.text
        assert whole.usage is not None and whole.usage.completion_tokens == 24
        streamed = ""
        async for chunk in await client.completions.create(
            model=model,
            prompt="The capital of France is",
            max_tokens=24,
            temperature=0,
            stream=True,
        ):
            streamed += chunk.choices[0].text if chunk.choices else ""
        assert streamed == choice.text  # greedy: the same tokens, whichever engine served it

        messages: list[openai.types.chat.ChatCompletionMessageParam] = [
            {"role": "user", "content": "Say hello."}
        ]
        chat = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=16, temperature=0
        )
        assert chat.choices[0].message.content
        assert chat.usage is not None and chat.usage.completion_tokens == 16
        deltas = [
            chunk.choices[0].delta.content or ""
            async for chunk in await client.chat.completions.create(
                model=model, messages=messages, max_tokens=16, temperature=0, stream=True
            )
            if chunk.choices
        ]
        assert "".join(deltas) == chat.choices[0].message.content


async def _engines_idle(tree: Tree) -> bool:
    for worker in WORKERS:
        if (await tree.engine_stats(worker)).engine_in_flight != 0:
            return False
    return True


async def test_aborts_before_the_first_token_and_mid_stream_reach_sglang(tree: Tree) -> None:
    async with openai_client(tree) as client:
        model = (await client.models.list()).data[0].id
        # Mid-stream: the client goes away after a few chunks.
        stream = await client.completions.create(
            model=model, prompt="Count to a thousand:", max_tokens=4000, temperature=0, stream=True
        )
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.close()
        # A client that leaves as soon as its request is sent (a long prompt: most likely
        # before its first token).
        async with client.completions.with_streaming_response.create(
            model=model, prompt="x " * 3000, max_tokens=4000, temperature=0, stream=True
        ):
            pass
    # SGLang itself lets the requests go (its tokenizer manager's registry empties), well before
    # 4,000 tokens could have been generated.
    await wait_until(lambda: _engines_idle(tree), timeout=60)


async def test_health_canaries_pass_on_the_real_engine(tree: Tree) -> None:
    def passed() -> float:
        return sum(
            s.value
            for s in next(iter(CANARIES.collect())).samples
            if s.name.endswith("_total")
            and s.labels.get("worker") in WORKERS
            and s.labels.get("outcome") == "ok"
        )

    before = passed()
    await wait_until(lambda: passed() >= before + 2, timeout=120)
    assert all(tree.serving.model().table.workers[w].healthy for w in WORKERS)


async def test_kv_aware_routing_follows_sglang_kv_events(tree: Tree) -> None:
    tokenizer = tree.serving.model().tokenizer
    prefix = "Once upon a time, in a land of rivers and stone, " * 12
    async with openai_client(tree) as client:
        model = (await client.models.list()).data[0].id
        await client.completions.create(model=model, prompt=prefix, max_tokens=4, temperature=0)
        tokens = tokenizer.encode(prefix)
        table = tree.serving.model().table
        # SGLang's own events reach the router, and its pages match the router's hashes of the
        # same tokens: the worker that served the prompt holds its full pages.
        full_pages = len(tokens) // table.workers[WORKERS[0]].capacity.block_size
        await wait_until(
            lambda: max(table.overlap(w, tokens) for w in WORKERS) >= full_pages - 1, timeout=30
        )
        holder = max(WORKERS, key=lambda w: table.overlap(w, tokens))
        other = next(w for w in WORKERS if w != holder)
        assert table.overlap(other, tokens) == 0
        # The same prefix with new endings goes where the prefix is cached: SGLang reports it
        # cached (the other engine never saw it, it would report none).
        for i in range(6):
            answer = await client.completions.create(
                model=model, prompt=f"{prefix} Chapter {i}.", max_tokens=2, temperature=0
            )
            usage = answer.usage
            assert usage is not None and usage.prompt_tokens_details is not None
            assert (usage.prompt_tokens_details.cached_tokens or 0) >= len(tokens) - 16


async def test_sglang_load_metrics_feed_the_publisher_and_the_router(tree: Tree) -> None:
    table = tree.serving.model().table
    busy: set[str] = set()

    async def watch() -> None:
        while True:
            busy.update(w for w in WORKERS if table.workers[w].reported_active > 0)
            await anyio.sleep(0.005)

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        await stream_all(tree, [f"Load {i}:" for i in range(8)])
        tg.cancel_scope.cancel()
    # SGLang's schedulers pushed their KvMetrics: both engines were seen running requests, and
    # both are idle again; the publisher's gauges carry the engines' own KV block counts.
    assert busy == set(WORKERS)
    await wait_until(lambda: all(table.workers[w].reported_active == 0 for w in WORKERS))
    for worker in WORKERS:
        total = REGISTRY.get_sample_value(
            "actorserve_worker_total_blocks", {"worker": worker, "dp_rank": "0"}
        )
        assert total == table.workers[worker].capacity.total_kv_blocks


async def test_sigkill_of_an_engine_mid_stream_is_migrated_token_for_token(tree: Tree) -> None:
    prompts = [f"Story number {i}: it began when" for i in range(4)]
    baseline = await stream_all(tree, prompts)
    pids = {w: (await tree.engine_stats(w)).pid for w in WORKERS}
    assert await stream_all(tree, prompts, sigkill(tree, "aggregated")) == baseline
    # The killed worker comes back (a fresh SGLang: start and warm-up) and serves again.
    await tree.wait_ready(2, timeout=600)
    after = {w: (await tree.engine_stats(w)).pid for w in WORKERS}
    assert sum(after[w] != pids[w] for w in WORKERS) == 1
