"""One prefill and two decode SGLang engines on one GPU, KV moved by SGLang's own NIXL transfer:
streams through the `openai` client, a decode engine SIGKILLed mid-stream and a prefill engine
SIGKILLed under load, every stream equal to the fault-free run."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator

import anyio
import openai
import pytest

from actors.testing import wait_until
from tests.gpu.conftest import MODEL, sglang_args
from tests.helpers.serving import Tree, serving_tree

PROMPTS = [f"Story number {i}: it began when" for i in range(4)]


@pytest.fixture(scope="module")
async def tree() -> AsyncIterator[Tree]:
    async with serving_tree(
        ready_timeout=900,
        backend="sglang",
        mode="disaggregated",
        prefill_workers=1,
        decode_workers=2,
        router="round_robin",
        tokenizer=str(MODEL),
        health_timeout=30.0,
        stall_timeout=120.0,
        engine_args=sglang_args(0.2, enable_deterministic_inference=True),
    ) as tree:
        yield tree


async def _streams(tree: Tree, kill: str | None = None) -> list[str]:
    """The four prompts streamed at once; ``kill``: SIGKILL that role's busiest worker, a decode
    worker once every stream has output, the prefill worker once the first has (the others
    still being prefilled or waiting for their KV)."""
    texts = [""] * len(PROMPTS)
    async with openai.AsyncOpenAI(base_url=f"{tree.url}/v1", api_key="-", max_retries=0) as c:
        model = (await c.models.list()).data[0].id

        async def one(i: int) -> None:
            async for chunk in await c.completions.create(
                model=model, prompt=PROMPTS[i], max_tokens=256, temperature=0, stream=True
            ):
                texts[i] += chunk.choices[0].text if chunk.choices else ""

        async with anyio.create_task_group() as tg:
            for i in range(len(PROMPTS)):
                tg.start_soon(one, i)
            if kill is not None:
                started = all if kill == "decode" else any
                await wait_until(lambda: started(texts), timeout=120)
                workers = [w for w, r in tree.serving.roles.items() if r == kill]
                stats = {w: await tree.engine_stats(w) for w in workers}
                victim = max(workers, key=lambda w: stats[w].running)
                os.kill(stats[victim].pid, signal.SIGKILL)
    return texts


async def test_streams_through_prefill_and_decode(tree: Tree) -> None:
    texts = await _streams(tree)
    assert all(texts)
    assert texts == await _streams(tree)  # greedy on the same weights: the same tokens


async def test_decode_sigkill_mid_stream_is_migrated_token_for_token(tree: Tree) -> None:
    baseline = await _streams(tree)
    assert await _streams(tree, kill="decode") == baseline
    await tree.wait_ready(3, timeout=600)


async def test_prefill_sigkill_under_load_loses_nothing(tree: Tree) -> None:
    baseline = await _streams(tree)
    # Requests whose KV arrived keep decoding; the others are prefilled again once the prefill
    # worker is back.
    assert await _streams(tree, kill="prefill") == baseline
    await tree.wait_ready(3, timeout=600)
