"""Shared helpers of the mock engine tests."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Sequence
from typing import Any

from actors.serving.engines import MockEngine, MockEngineConfig, TimingModel
from protocols.engine import (
    BootstrapInfo,
    EngineOutput,
    PreprocessedRequest,
    RoutingHints,
    SamplingOptions,
    StopConditions,
)

# The KV pages live on the host unless ACTORSERVE_MOCK_DEVICE says otherwise (a GPU host runs
# the same tests with ``cuda``).
DEVICE = os.environ.get("ACTORSERVE_MOCK_DEVICE", "cpu")
if DEVICE == "cuda":
    import torch

    torch.cuda.init()  # before any test: the CUDA runtime keeps a socket of its own
INSTANT = TimingModel(instant=True)
FAST = TimingModel(speedup=200.0)  # real (simulated) time, but fast


def config(**overrides: Any) -> MockEngineConfig:
    """A small engine: 64 blocks of 16 tokens, instant, tiny memory stand-ins."""
    base: dict[str, Any] = {
        "num_blocks": 64,
        "block_size": 16,
        "kv_bytes_per_block": 256,
        "max_running_requests": 16,
        "max_batch_tokens": 512,
        "context_length": 4096,
        "weights_bytes": 4096,
        "cuda_graph_bytes": 4096,
        "device": DEVICE,
        "timing": INSTANT,
        "instant_yield_s": 0.0005,
    }
    base.update(overrides)
    return MockEngineConfig(**base)


def request(
    rid: str,
    tokens: Sequence[int],
    *,
    max_tokens: int | None = 8,
    min_tokens: int | None = None,
    ignore_eos: bool = False,
    stop_token_ids: list[int] | None = None,
    eos_token_ids: Sequence[int] = (),
    temperature: float | None = None,
    seed: int | None = None,
    dp_rank: int | None = None,
    bootstrap: BootstrapInfo | None = None,
) -> PreprocessedRequest:
    return PreprocessedRequest(
        rid=rid,
        token_ids=list(tokens),
        stop_conditions=StopConditions(
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            ignore_eos=ignore_eos,
            stop_token_ids=stop_token_ids,
        ),
        sampling_options=SamplingOptions(temperature=temperature, seed=seed),
        eos_token_ids=list(eos_token_ids),
        routing=RoutingHints(dp_rank=dp_rank) if dp_rank is not None else None,
        bootstrap_info=bootstrap,
    )


async def collect(stream: AsyncIterator[EngineOutput]) -> list[EngineOutput]:
    return [out async for out in stream]


def tokens_of(outputs: Sequence[EngineOutput]) -> list[int]:
    return [t for out in outputs for t in out.token_ids]


async def run(engine: MockEngine, req: PreprocessedRequest) -> tuple[list[int], EngineOutput]:
    """Generate to the end; the tokens and the final output."""
    outputs = await collect(engine.generate(req))
    return tokens_of(outputs), outputs[-1]


def memory_in_use() -> int:
    """Bytes the process holds where the KV pages live: RSS, or CUDA memory reserved."""
    if DEVICE == "cuda":
        import torch

        return int(torch.cuda.memory_reserved())
    import psutil

    return int(psutil.Process().memory_info().rss)
