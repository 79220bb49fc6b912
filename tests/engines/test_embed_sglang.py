"""The SGLang backend serving an embedding model (``kind="embedding"``), against the fakes.

See tests/engines/_sglang_fakes.py: ``TokenizerManager.generate_request`` with an
``EmbeddingReqInput`` answers once with the vector.
"""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from actors.serving.engines._sglang import SGLangEngine
from actors.testing import wait_until
from protocols.engine import EmbedOptions, EngineOutput, PreprocessedRequest, Usage
from protocols.errors import InvalidRequest
from tests.engines._sglang_fakes import (
    FakeSGLang,
    Record,
    collect,
    fake_embedding,
    request,
    running,
)


def embed(rid: str, tokens: list[int], dimensions: int | None = None) -> PreprocessedRequest:
    return PreprocessedRequest(rid=rid, token_ids=tokens, embed=EmbedOptions(dimensions=dimensions))


def test_kind_is_checked_and_embedding_sets_is_embedding() -> None:
    with pytest.raises(ValueError, match="kind"):
        SGLangEngine({"model_path": "/m"}, kind="video")
    with pytest.raises(ValueError, match="aggregated"):
        SGLangEngine({"model_path": "/m"}, kind="embedding", role="prefill")
    with pytest.raises(ValueError, match="is_embedding"):
        SGLangEngine({"model_path": "/m", "is_embedding": False}, kind="embedding")


async def test_embed_request_answers_the_vector(anyio_backend: str, fake: FakeSGLang) -> None:
    async with running(anyio_backend, fake, kind="embedding") as engine:
        if engine is None:
            return
        (init,) = fake.args_of("Engine.__init__")
        assert init["kwargs"]["is_embedding"] is True
        # The warm-up was an embed, not a generate (an embedding model cannot generate).
        assert not fake.args_of("Engine.async_generate")
        (out,) = await collect(engine.generate(embed("e1", [4, 5, 6])))
        assert out.finish_reason == "stop" and out.token_ids == []
        assert out.usage == Usage(prompt_tokens=3, completion_tokens=0)
        assert out.embedding is not None
        vector = np.frombuffer(out.embedding, dtype="<f4")
        sent = fake.args_of("TokenizerManager.generate_request")[-1]
        assert (sent["obj"].input_ids, sent["obj"].rid, sent["request"]) == ([4, 5, 6], "e1", None)
        assert vector.tolist() == fake_embedding([4, 5, 6], fake.embedding_dim)
        (same,) = await collect(engine.generate(embed("e2", [4, 5, 6], dimensions=8)))
        assert same.embedding == out.embedding
        payload = engine.health_payload()
        assert payload.embed is not None and payload.health_check
        (health,) = await collect(engine.generate(payload))
        assert health.finish_reason == "stop"
        assert engine.is_quiescent() and not fake.engines[0].tokenizer_manager.rid_to_state


async def test_embed_refusals(anyio_backend: str, fake: FakeSGLang) -> None:
    async with running(anyio_backend, fake, kind="embedding", warmup=False) as engine:
        if engine is None:
            return
        with pytest.raises(InvalidRequest, match="needs 'embed'"):
            await collect(engine.generate(request("chat")))
        with pytest.raises(InvalidRequest, match=">= 1"):
            await collect(engine.generate(embed("z", [1], dimensions=0)))
        # The native size is learnt from the first answer; before it SGLang's answer is checked.
        with pytest.raises(InvalidRequest, match="have 8 dimensions"):
            await collect(engine.generate(embed("d1", [1, 2], dimensions=4)))
        with pytest.raises(InvalidRequest, match="have 8 dimensions"):
            await collect(engine.generate(embed("d2", [1, 2], dimensions=16)))
        assert len([c for c in fake.calls if c[0] == "Engine.async_generate"]) == 0
        # SGLang's own validation error is the client's invalid request.
        with pytest.raises(InvalidRequest, match="longer"):
            await collect(engine.generate(embed("long", [666])))
        assert engine.is_quiescent()
    async with running(anyio_backend, fake, warmup=False) as chat:
        assert chat is not None
        with pytest.raises(InvalidRequest, match="not embeddings"):
            await collect(chat.generate(embed("e", [1, 2, 3])))


async def test_abort_an_embed_request(anyio_backend: str, fake: FakeSGLang) -> None:
    async with running(anyio_backend, fake, kind="embedding", warmup=False) as engine:
        if engine is None:
            return
        tm = fake.engines[0].tokenizer_manager
        results: list[EngineOutput] = []

        async def consume(rid: str) -> None:
            results.extend(await collect(engine.generate(embed(rid, [1, 2, 3]))))

        # Dispatched, not answered: aborted in SGLang's scheduler, cancelled at once.
        fake.hold_first_token = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume, "held")
            await wait_until(
                lambda: "held" in tm.rid_to_state and tm.rid_to_state["held"].dispatched
            )
            await engine.abort("held")
        assert [o.finish_reason for o in results] == ["cancelled"]
        assert {"rid": "held"} in fake.args_of("TokenizerManager.abort_request")
        assert fake.aborted_in_scheduler() == ["held"] and not tm.rid_to_state
        # Not dispatched yet: nothing reaches the scheduler, SGLang drops it locally.
        fake.hold_first_token = None
        fake.hold_dispatch = anyio.Event()
        results.clear()
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume, "early")
            await wait_until(lambda: "early" in fake.held_before_dispatch)
            await engine.abort("early")
        assert [o.finish_reason for o in results] == ["cancelled"]
        assert fake.lost_aborts == [] and fake.aborted_in_scheduler() == ["held"]
        assert not tm.rid_to_state and engine.is_quiescent()
        # Aborted before its generate began: it never reaches SGLang.
        fake.hold_dispatch = None
        await engine.abort("before")
        (out,) = await collect(engine.generate(embed("before", [1])))
        assert out.finish_reason == "cancelled"
        # Shutdown while one waits: EngineShutdown (the stream ends with the engine).
        fake.hold_first_token = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume_until_error, engine, results)
            await wait_until(lambda: "late" in tm.rid_to_state)
            await engine.cleanup()
        assert results[-1].error == "EngineShutdown"


async def consume_until_error(engine: SGLangEngine, into: list[EngineOutput]) -> None:
    """Collect ``late``'s outputs; an error ends it as an output naming the error's class."""
    try:
        into.extend(await collect(engine.generate(embed("late", [1, 2]))))
    except Exception as exc:
        into.append(EngineOutput(finish_reason="error", error=type(exc).__name__))


def test_the_fake_request_class_takes_what_the_backend_sends(record: Record) -> None:
    """The record's ``EmbeddingReqInput``: ``rid`` is keyword-only, an unknown field fails."""
    obj = record.EmbedReq(input_ids=[1, 2], rid="r")
    assert (obj.input_ids, obj.rid, obj.text) == ([1, 2], "r", None)
    with pytest.raises(TypeError):
        record.EmbedReq(prompt="x")
    assert record.EmbedReq("hello").rid is None  # the first positional field is text
