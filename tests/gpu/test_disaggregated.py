"""One prefill and two decode SGLang engines on one GPU, KV moved by SGLang's own NIXL transfer:
streams through the `openai` client, a decode engine SIGKILLed mid-stream and a prefill engine
SIGKILLed under load, every stream equal to the fault-free run."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.gpu.conftest import MODEL, sglang_args, sigkill, stream_all
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


async def test_streams_through_prefill_and_decode(tree: Tree) -> None:
    texts = await stream_all(tree, PROMPTS)
    assert all(texts)
    assert texts == await stream_all(tree, PROMPTS)  # greedy on the same weights: the same tokens


async def test_decode_sigkill_mid_stream_is_migrated_token_for_token(tree: Tree) -> None:
    baseline = await stream_all(tree, PROMPTS)
    assert await stream_all(tree, PROMPTS, sigkill(tree, "decode")) == baseline
    await tree.wait_ready(3, timeout=600)


async def test_prefill_sigkill_under_load_loses_nothing(tree: Tree) -> None:
    baseline = await stream_all(tree, PROMPTS)
    # Requests whose KV arrived keep decoding; the others are prefilled again once the prefill
    # worker is back.
    assert await stream_all(tree, PROMPTS, sigkill(tree, "prefill"), once=any) == baseline
    await tree.wait_ready(3, timeout=600)
