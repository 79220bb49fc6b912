"""Memory release and resume on real SGLang (its memory saver, torch_memory_saver): two aggregated
engines with streams in flight; one engine's KV cache and weights released mid-stream, its
requests migrated to the other token for token, its GPU memory given back and taken again; then
it serves again with the same weights (a CPU backup: dummy weights cannot be loaded again)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from actors.serving.root._lifecycle import Release, Resume, WorkerStates
from protocols.engine import MemoryTag
from tests.gpu.conftest import MODEL, busiest, gpu_memory, sglang_args, stream_all
from tests.helpers.serving import Tree, serving_tree

PROMPTS = [f"Story number {i}: it began when" for i in range(4)]
WORKERS = ["decode-0", "decode-1"]
FRACTION = 0.3  # of the GPU's memory, per engine: its weights and KV cache


@pytest.fixture(scope="module")
async def tree() -> AsyncIterator[Tree]:
    async with serving_tree(
        ready_timeout=900,
        backend="sglang",
        mode="aggregated",
        decode_workers=2,
        router="round_robin",
        memory_release=True,
        tokenizer=str(MODEL),
        health_timeout=30.0,
        stall_timeout=120.0,
        engine_args=sglang_args(
            FRACTION, enable_deterministic_inference=True, enable_weights_cpu_backup=True
        ),
    ) as tree:
        yield tree


async def test_release_and_resume_under_load_migrates_and_frees_the_gpu(tree: Tree) -> None:
    baseline = await stream_all(tree, PROMPTS)
    used: dict[str, int] = {}
    states: dict[str, str] = {}
    victim = ""

    async def release_and_resume() -> None:
        nonlocal victim
        victim = await busiest(tree, "aggregated")
        used["serving"] = gpu_memory()[0]
        await tree.lifecycle.ask(
            Release(worker=victim, tags=(MemoryTag.KV_CACHE, MemoryTag.WEIGHTS)), timeout=None
        )
        used["released"] = gpu_memory()[0]
        states["released"] = (await tree.lifecycle.ask(WorkerStates()))[victim]["state"]
        await tree.lifecycle.ask(Resume(worker=victim), timeout=None)
        used["resumed"] = gpu_memory()[0]
        states["resumed"] = (await tree.lifecycle.ask(WorkerStates()))[victim]["state"]

    pids = {w: (await tree.engine_stats(w)).pid for w in WORKERS}
    assert await stream_all(tree, PROMPTS, release_and_resume) == baseline
    assert states == {"released": "released", "resumed": "serving"}
    # Most of an engine's share is its KV cache: released, the GPU has it back; resumed, taken.
    share = FRACTION * gpu_memory()[1]
    assert used["serving"] - used["released"] > share / 2, used
    assert used["resumed"] - used["released"] > share / 2, used
    assert {w: (await tree.engine_stats(w)).pid for w in WORKERS} == pids  # never restarted
    # Back in routing with the same weights: it serves the baseline again, token for token.
    before = (await tree.engine_stats(victim)).finished
    assert await stream_all(tree, PROMPTS) == baseline
    assert (await tree.engine_stats(victim)).finished > before
