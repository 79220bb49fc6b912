"""Measuring a performance profile: prefills of each input length on an idle engine, then decodes
at each concurrency and context length, timed through the engine contract."""

from __future__ import annotations

import itertools
import statistics

import anyio
import attrs
import numpy as np

from actors.serving.engines import MockEngine, MockEngineConfig
from actors.serving.planner._profile import PerformanceProfile, check_axis
from protocols.engine import Engine, PreprocessedRequest, StopConditions

__all__ = ["ProfileGrid", "measure_profile", "profile_mock"]

# Prompt tokens are drawn below this: every model's vocabulary holds them.
_TOKEN_CEILING = 1000


def _ascending(
    _: object, attribute: attrs.Attribute[tuple[int, ...]], axis: tuple[int, ...]
) -> None:
    check_axis(attribute.name, axis)


@attrs.frozen
class ProfileGrid:
    """The points to measure: ``repeats`` prefills per ISL (their median counts); decodes of
    ``decode_tokens`` tokens a request at each (context, concurrency)."""

    isl: tuple[int, ...] = attrs.field(default=(128, 512, 1024, 2048, 4096), validator=_ascending)
    concurrency: tuple[int, ...] = attrs.field(default=(1, 2, 4, 8, 16, 32), validator=_ascending)
    context: tuple[int, ...] = attrs.field(default=(512, 2048), validator=_ascending)
    decode_tokens: int = attrs.field(default=32, validator=attrs.validators.ge(4))
    repeats: int = attrs.field(default=2, validator=attrs.validators.ge(1))


class _Prompts:
    """Prompts no two alike, so that no prefix cache serves one from another."""

    def __init__(self) -> None:
        self._count = itertools.count()

    def request(self, length: int, max_tokens: int) -> PreprocessedRequest:
        n = next(self._count)
        tokens = np.random.default_rng(n).integers(3, _TOKEN_CEILING, length)
        return PreprocessedRequest(
            rid=f"profile-{n}",
            token_ids=tokens.tolist(),
            stop_conditions=StopConditions(max_tokens=max_tokens, ignore_eos=True),
        )


async def _arrivals(engine: Engine, request: PreprocessedRequest) -> list[tuple[float, int]]:
    """When each output with tokens arrived, and how many it carried."""
    return [
        (anyio.current_time(), len(output.token_ids))
        async for output in engine.generate(request)
        if output.token_ids
    ]


async def _ttft_s(engine: Engine, prompts: _Prompts, isl: int) -> float:
    start = anyio.current_time()
    arrivals = await _arrivals(engine, prompts.request(isl, max_tokens=1))
    return arrivals[0][0] - start


async def _itl_s(
    engine: Engine, prompts: _Prompts, grid: ProfileGrid, context: int, n: int
) -> float:
    streams: list[list[tuple[float, int]]] = [[] for _ in range(n)]

    async def run(i: int) -> None:
        streams[i] = await _arrivals(engine, prompts.request(context, grid.decode_tokens))

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(run, i)
    # Only while every request decodes: after the last prefill, before the first one ends.
    start = max(stream[0][0] for stream in streams)
    end = min(stream[-1][0] for stream in streams)
    spans = []
    for stream in streams:
        window = [(t, k) for t, k in stream if start <= t <= end]
        tokens = sum(k for _, k in window[1:])
        if tokens:
            spans.append((window[-1][0] - window[0][0]) / tokens)
    if not spans:
        raise ValueError(
            f"decode_tokens {grid.decode_tokens} leaves no time when all {n} requests at "
            f"{context} tokens decode together: raise it"
        )
    return statistics.fmean(spans)


async def measure_profile(
    engine: Engine, grid: ProfileGrid, *, name: str, time_scale: float = 1.0
) -> PerformanceProfile:
    """Measure ``engine`` (started, idle, serving nothing else) at the points of ``grid``;
    ``time_scale`` multiplies every time measured (a simulated engine's speed-up)."""
    prompts = _Prompts()
    await _ttft_s(engine, prompts, grid.isl[0])  # a first request may pay for warming up
    ttft_ms = []
    for isl in grid.isl:
        times = [await _ttft_s(engine, prompts, isl) for _ in range(grid.repeats)]
        ttft_ms.append(statistics.median(times) * time_scale * 1000.0)
    itl_ms = [
        [
            await _itl_s(engine, prompts, grid, context, n) * time_scale * 1000.0
            for n in grid.concurrency
        ]
        for context in grid.context
    ]
    return PerformanceProfile(
        engine=name,
        prefill_isl=list(grid.isl),
        prefill_ttft_ms=ttft_ms,
        decode_concurrency=list(grid.concurrency),
        decode_context=list(grid.context),
        decode_itl_ms=itl_ms,
    )


async def profile_mock(config: MockEngineConfig, grid: ProfileGrid) -> PerformanceProfile:
    """The profile of a mock engine built from ``config``, in its simulated time (measured at
    its timing model's speed-up; the engine's own CPU work counts times the speed-up too, so a
    lower one measures closer to the timing model)."""
    timing = config.timing
    if timing.instant:
        raise ValueError("an instant mock engine takes no time to measure")
    async with MockEngine(config) as engine:
        return await measure_profile(
            engine,
            grid,
            name=f"mock {config.model} ({config.role}, speed-up {timing.speedup:g})",
            time_scale=timing.speedup,
        )
