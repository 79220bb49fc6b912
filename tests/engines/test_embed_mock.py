"""The mock engine as an embedding model (``kind="embedding"``): deterministic vectors through the
scheduler (timing, abort, shutdown as any prompt), and refusals by kind and dimensions."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from actors.serving.engines import MockEngine, TimingModel
from actors.serving.engines._mock._embed import mock_embedding
from actors.testing import wait_until
from protocols.engine import EmbedOptions, EngineOutput, PreprocessedRequest, Usage
from protocols.errors import EngineShutdown, InvalidRequest
from tests.engines._mock_helpers import FAST, collect, config, request


def embed(rid: str, tokens: list[int], dimensions: int | None = None) -> PreprocessedRequest:
    return PreprocessedRequest(rid=rid, token_ids=tokens, embed=EmbedOptions(dimensions=dimensions))


def vector(out: EngineOutput) -> np.ndarray:
    assert out.embedding is not None
    return np.frombuffer(out.embedding, dtype="<f4")


async def test_embed_answers_one_deterministic_unit_vector() -> None:
    async with MockEngine(config(kind="embedding", timing=FAST)) as engine:
        (out,) = await collect(engine.generate(embed("e1", [1, 2, 3, 4])))
        assert out.finish_reason == "stop" and out.token_ids == []
        assert out.usage == Usage(prompt_tokens=4, completion_tokens=0)
        v = vector(out)
        assert v.shape == (384,)
        assert abs(float(np.linalg.norm(v)) - 1.0) < 1e-5
        (again,) = await collect(engine.generate(embed("e2", [1, 2, 3, 4], dimensions=384)))
        assert again.embedding == out.embedding  # a pure function of the ids
        (other,) = await collect(engine.generate(embed("e3", [1, 2, 3, 5])))
        assert other.embedding != out.embedding
        assert out.embedding == mock_embedding([1, 2, 3, 4], 384)
        # It ran as a prompt: the simulated prefill was charged, nothing was generated.
        stats = engine.statistics()
        assert stats.prefill_tokens > 0 and stats.generated_tokens == 0
        assert stats.ranks[0].simulated_s > 0
        assert engine.is_quiescent()


async def test_embedding_dim_is_configurable_and_concurrent_requests_all_answer() -> None:
    async with MockEngine(config(kind="embedding", embedding_dim=16)) as engine:
        results: dict[str, EngineOutput] = {}

        async def one(rid: str, tokens: list[int]) -> None:
            (results[rid],) = await collect(engine.generate(embed(rid, tokens)))

        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(one, f"c{i}", [5, 6, i + 10])
        assert sorted(results) == [f"c{i}" for i in range(6)]
        for i in range(6):
            assert vector(results[f"c{i}"]).shape == (16,)
            assert results[f"c{i}"].embedding == mock_embedding([5, 6, i + 10], 16)


async def test_refusals_by_kind_and_dimensions() -> None:
    async with MockEngine(config(kind="embedding")) as engine:
        with pytest.raises(InvalidRequest, match="needs 'embed'"):
            await collect(engine.generate(request("chat", [1, 2, 3])))
        with pytest.raises(InvalidRequest, match="384"):
            await collect(engine.generate(embed("d", [1, 2], dimensions=128)))
        with pytest.raises(InvalidRequest, match=">= 1"):
            await collect(engine.generate(embed("z", [1, 2], dimensions=0)))
        with pytest.raises(InvalidRequest, match="empty"):
            await collect(engine.generate(embed("n", [])))
        assert engine.is_quiescent()
    async with MockEngine(config()) as chat:
        with pytest.raises(InvalidRequest, match="not embeddings"):
            await collect(chat.generate(embed("e", [1, 2, 3])))
        outs = await collect(chat.generate(request("ok", [1, 2, 3], max_tokens=2)))
        assert outs[-1].finish_reason == "length"


async def test_health_payload_is_an_embed_request_the_engine_answers() -> None:
    async with MockEngine(config(kind="embedding")) as engine:
        payload = engine.health_payload()
        assert payload.embed is not None and len(payload.token_ids) == 1
        (out,) = await collect(engine.generate(payload))
        assert out.finish_reason == "stop" and out.embedding is not None
    async with MockEngine(config()) as chat:
        assert chat.health_payload().embed is None


async def test_abort_and_shutdown_end_an_embed_request() -> None:
    slow = config(kind="embedding", timing=TimingModel(speedup=0.001))  # a 16 s prefill
    async with MockEngine(slow) as engine:
        results: list[EngineOutput] = []

        async def consume(rid: str) -> None:
            results.extend(await collect(engine.generate(embed(rid, [1, 2, 3]))))

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume, "a1")
            await wait_until(lambda: engine.phase_of("a1") == "prefill")
            await engine.abort("a1")
        assert [o.finish_reason for o in results] == ["cancelled"]
        assert results[0].embedding is None
        assert engine.is_quiescent()
        # Closing the stream early aborts it too.
        stream = engine.generate(embed("a2", [1, 2, 3]))
        await stream.aclose()
        await engine.wait_quiescent()
        # Shutdown while it runs: EngineShutdown.
        failed: list[BaseException] = []

        async def doomed() -> None:
            try:
                await collect(engine.generate(embed("a3", [1, 2, 3])))
            except EngineShutdown as exc:
                failed.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(doomed)
            await wait_until(lambda: engine.phase_of("a3") is not None)
            await engine.cleanup()
        assert len(failed) == 1
