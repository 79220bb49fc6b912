"""A block-diffusion model served end to end (the mock as ``kind="dllm"``, workers in child
processes): its text streams in blocks; an output with neither tokens nor a finish is a
migratable error whose migration replays the blocks sent so far; a SIGKILL of the worker mid-stream
leaves every stream's text as a fault-free run's."""

from __future__ import annotations

import os
import signal
from typing import Any

import anyio
import httpx

from actors.telemetry import REGISTRY
from tests.helpers.serving import Tree, serving_tree
from tests.serving.test_e2e import _stream_text

BLOCK = 8
TOKENS = 96  # 12 blocks
# The model's name is given: a dllm model's default name is not the one the clients ask for.
DLLM: dict[str, Any] = {"model": "mock", "kind": "dllm", "mode": "aggregated"}


def _engine(**more: Any) -> dict[str, Any]:
    return {"dllm_block_tokens": BLOCK, "dllm_rounds": 4, **more}


def _migrations(tree: Tree) -> float:
    labels = {"model": tree.serving.config.model, "migration_type": "ongoing_request"}
    return REGISTRY.get_sample_value("actorserve_frontend_model_migration_total", labels) or 0.0


def _blockwise(result: dict[str, Any]) -> bool:
    """Whether a stream came in blocks (at most one chunk per block), not token by token."""
    chunks: int = result["chunks"]
    return 0 < chunks <= -(-TOKENS // BLOCK)


async def test_an_empty_output_migrates_and_the_text_is_unchanged() -> None:
    prompts = [f"diffuse me {i}" for i in range(4)]
    async with serving_tree(**DLLM, decode_workers=1, engine_args=_engine()) as tree:
        async with httpx.AsyncClient(base_url=tree.url) as client:
            clean = [await _stream_text(client, p, TOKENS) for p in prompts]
    async with serving_tree(
        **DLLM, decode_workers=1, engine_args=_engine(dllm_empty_chunk_after=3)
    ) as tree:
        before = _migrations(tree)
        async with httpx.AsyncClient(base_url=tree.url) as client:
            faulted = [await _stream_text(client, p, TOKENS) for p in prompts]
        # Each first attempt sent an empty output after 3 blocks: one migration each, whose
        # continuation (the prompt and those 3 blocks, generated=24) the engine serves whole.
        assert _migrations(tree) - before == len(prompts)
    for i, (want, got) in enumerate(zip(clean, faulted, strict=True)):
        assert got["error"] is None, got["error"]
        assert got["text"] == want["text"], i
        assert got["finish"] == "length" and got["usage"]["completion_tokens"] == TOKENS
        assert _blockwise(want) and _blockwise(got), (want["chunks"], got["chunks"])


async def test_sigkill_of_the_worker_mid_stream_every_stream_completes_unchanged() -> None:
    prompts = [f"request {i}: diffuse something long" for i in range(12)]
    async with serving_tree(
        **DLLM,
        decode_workers=2,
        router="round_robin",
        engine_args=_engine(timing={"speedup": 1.0}),
    ) as tree:
        chunks = [0] * len(prompts)  # chunks each stream has had so far

        async def run(client: httpx.AsyncClient, i: int, into: dict[int, dict[str, Any]]) -> None:
            def seen(n: int) -> None:
                chunks[i] = n

            into[i] = await _stream_text(client, prompts[i], TOKENS, on_chunk=seen)

        baseline: dict[int, dict[str, Any]] = {}
        async with httpx.AsyncClient(base_url=tree.url) as client, anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(run, client, i, baseline)
        victim = await tree.engine_stats("decode-0")
        before = _migrations(tree)
        chunks = [0] * len(prompts)
        faulted: dict[int, dict[str, Any]] = {}
        async with httpx.AsyncClient(base_url=tree.url) as client, anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(run, client, i, faulted)
            # Every stream has blocks out (none is done): the kill cuts some mid-way.
            with anyio.fail_after(30):
                while min(chunks) < 2:
                    await anyio.sleep(0.005)
            os.kill(victim.pid, signal.SIGKILL)
        assert _migrations(tree) > before  # the kill cut streams mid-way
    assert all(r["error"] is None for r in faulted.values()), [
        r["error"] for r in faulted.values() if r["error"]
    ]
    for i in range(len(prompts)):
        assert faulted[i]["text"] == baseline[i]["text"], i
        assert faulted[i]["finish"] == "length"
        assert faulted[i]["usage"]["completion_tokens"] == TOKENS
        assert _blockwise(baseline[i]) and _blockwise(faulted[i]), i
