"""Several models under one root, of every kind (mock engines in child processes): chat,
embeddings and images side by side through the ``openai`` client, each model its own subtree,
and one model crash-looping leaves the others serving."""

from __future__ import annotations

import base64
import io
import os
import signal
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from actors.serving import ModelConfig
from actors.testing import wait_until
from tests.helpers.serving import FAST_ENGINE, serving_tree, with_openai

EMBED = ModelConfig(kind="embedding", backend="mock", decode_workers=1, engine_args=FAST_ENGINE)
IMAGE = ModelConfig(kind="image", backend="mock", decode_workers=1, engine_args=FAST_ENGINE)
ALL_KINDS: dict[str, Any] = {"mode": "aggregated", "decode_workers": 1, "models": [EMBED, IMAGE]}


async def test_models_lists_every_model_and_each_path_takes_its_kind() -> None:
    async with serving_tree(**ALL_KINDS) as tree:
        assert sorted(tree.serving.roles) == [
            "mock-embedding/decode-0",
            "mock-image/decode-0",
            "mock/decode-0",
        ]
        listed = await with_openai(tree, lambda c: [m.id for m in c.models.list()])
        assert listed == ["mock", "mock-embedding", "mock-image"]
        children = [c.id for c in (await tree.root.which_children())]
        assert children[:3] == ["model:mock", "model:mock-embedding", "model:mock-image"]

        async with httpx.AsyncClient(base_url=tree.url) as http:
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            wrong = await http.post(
                "/v1/chat/completions", json={"model": "mock-embedding", **chat}
            )
            assert wrong.status_code == 400
            assert wrong.json()["error"]["param"] == "model"
            assert "serves embedding" in wrong.json()["error"]["message"]
            wrong = await http.post("/v1/embeddings", json={"model": "mock", "input": "x"})
            assert wrong.status_code == 400
            wrong = await http.post(
                "/v1/images/generations", json={"model": "mock-embedding", "prompt": "x"}
            )
            assert wrong.status_code == 400
            ok = await http.post("/v1/chat/completions", json={"model": "mock", **chat})
            assert ok.status_code == 200, ok.text
            health = (await http.get("/health")).json()
            assert sorted(health["models"]) == ["mock", "mock-embedding", "mock-image"]


async def test_embeddings_as_floats_and_base64_for_texts_and_token_ids() -> None:
    async with serving_tree(**ALL_KINDS) as tree:
        texts = ["a first sentence", "a second one", "a first sentence"]

        def embed(client: openai.OpenAI) -> tuple[Any, Any, Any]:
            floats = client.embeddings.create(
                model="mock-embedding", input=texts, encoding_format="float"
            )
            # The client asks for base64 by default and decodes it itself.
            packed = client.embeddings.create(model="mock-embedding", input=texts)
            ids = client.embeddings.create(model="mock-embedding", input=[[1, 2, 3], [1, 2, 3]])
            return floats, packed, ids

        floats, packed, ids = await with_openai(tree, embed)
        vectors = [d.embedding for d in floats.data]
        assert [d.index for d in floats.data] == [0, 1, 2]
        assert len(vectors[0]) == 384
        assert vectors[0] == vectors[2] != vectors[1]  # deterministic per input
        assert [d.embedding for d in packed.data] == vectors
        assert ids.data[0].embedding == ids.data[1].embedding
        assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0

        async with httpx.AsyncClient(base_url=tree.url) as http:
            raw = await http.post(
                "/v1/embeddings",
                json={"model": "mock-embedding", "input": "x", "encoding_format": "base64"},
            )
            data = raw.json()["data"][0]["embedding"]
            vector = np.frombuffer(base64.b64decode(data), dtype="<f4")
            assert vector.shape == (384,)
            assert abs(float(np.linalg.norm(vector)) - 1.0) < 1e-5
            for body, param in [
                ({"input": "x", "dimensions": 12}, None),  # the model is not cut to size
                ({"input": "x", "dimensions": 0}, "dimensions"),
                ({"input": "x", "dimensions": 2**64}, "dimensions"),  # found by the fuzzer
                ({"input": []}, "input"),
                ({"input": "x" * 100_000}, "input"),
            ]:
                refused = await http.post(
                    "/v1/embeddings", json={"model": "mock-embedding", **body}
                )
                assert refused.status_code == 400, (body, refused.text)
                if param is not None:
                    assert param in refused.text


async def test_images_inline_to_a_folder_and_streamed_with_progress(tmp_path: Path) -> None:
    async with serving_tree(image_dir=str(tmp_path / "images"), **ALL_KINDS) as tree:
        extra = {"num_inference_steps": 3, "seed": 7}

        def generate(client: openai.OpenAI) -> tuple[Any, Any, Any]:
            inline = client.images.generate(
                model="mock-image", prompt="a red fox", size="64x48", n=2, extra_body=extra
            )
            again = client.images.generate(
                model="mock-image", prompt="a red fox", size="64x48", extra_body=extra
            )
            stored = client.images.generate(
                model="mock-image",
                prompt="a red fox",
                size="64x48",
                response_format="url",
                extra_body=extra,
            )
            return inline, again, stored

        inline, again, stored = await with_openai(tree, generate)
        first = base64.b64decode(inline.data[0].b64_json)
        assert Image.open(io.BytesIO(first)).size == (64, 48)
        assert first == base64.b64decode(again.data[0].b64_json)  # the same seed
        assert inline.data[1].b64_json != inline.data[0].b64_json  # the next seed
        url = stored.data[0].url
        assert url.startswith(f"file://{tmp_path / 'images'}/")
        assert await anyio.Path(url.removeprefix("file://")).read_bytes() == first

        async with httpx.AsyncClient(base_url=tree.url) as http:
            body = {"model": "mock-image", "prompt": "a fox", "size": "32x32", "stream": True}
            events = []
            async with http.stream(
                "POST", "/v1/images/generations", json={**body, **extra}
            ) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line.removeprefix("data: "))
            assert events[-1] == "[DONE]"
            kinds = [e.split('"type":"')[1].split('"')[0] for e in events[:-1]]
            assert kinds == ["image_generation.progress"] * 3 + ["image_generation.completed"]
            for body, param in [
                ({"size": "64x4096"}, "size"),
                ({"size": "big"}, "size"),
                ({"quality": "hd"}, "quality"),
                ({"output_format": "jpeg"}, "output_format"),
            ]:
                refused = await http.post(
                    "/v1/images/generations", json={"model": "mock-image", "prompt": "x", **body}
                )
                assert refused.status_code == 400, (body, refused.text)
                assert param in refused.text


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_a_crash_looping_model_leaves_the_others_serving(tmp_path: Path) -> None:
    fail = str(tmp_path / "fail-{worker}")
    embed = ModelConfig(
        kind="embedding",
        backend="mock",
        decode_workers=1,
        quarantine_cooldown=60.0,
        engine_args={**FAST_ENGINE, "fail_start_file": fail},
    )
    async with serving_tree(mode="aggregated", decode_workers=1, models=[embed, IMAGE]) as tree:
        worker = "mock-embedding/decode-0"
        # Every restart of the embedding worker fails from now on.
        await anyio.Path(fail.replace("{worker}", worker.replace("/", "_"))).write_text("1000")
        chat_pid = (await tree.engine_stats("mock/decode-0")).pid
        image_pid = (await tree.engine_stats("mock-image/decode-0")).pid
        for _ in range(3):
            entry = tree.serving.table_of(worker).workers.get(worker)
            if entry is not None:
                os.kill((await tree.engine_stats(worker)).pid, signal.SIGKILL)
            await anyio.sleep(0.5)

        async with httpx.AsyncClient(base_url=tree.url) as http:

            async def embedding_down() -> bool:
                health = (await http.get("/health")).json()["models"]
                return health["mock-embedding"]["status"] == "notready"

            await wait_until(embedding_down, timeout=30)
            chat = await http.post(
                "/v1/chat/completions",
                json={"model": "mock", "messages": [{"role": "user", "content": "hi"}]},
            )
            assert chat.status_code == 200, chat.text
            image = await http.post(
                "/v1/images/generations",
                json={"model": "mock-image", "prompt": "x", "size": "16x16", "seed": 1},
            )
            assert image.status_code == 200, image.text
            embedding = await http.post(
                "/v1/embeddings", json={"model": "mock-embedding", "input": "x"}
            )
            assert embedding.status_code == 503
            health = (await http.get("/health")).json()["models"]
            assert health["mock"]["status"] == health["mock-image"]["status"] == "ready"
        assert (await tree.engine_stats("mock/decode-0")).pid == chat_pid
        assert (await tree.engine_stats("mock-image/decode-0")).pid == image_pid
        await anyio.Path(fail.replace("{worker}", worker.replace("/", "_"))).unlink()


async def test_embeddings_on_a_killed_worker_are_retried_on_the_other() -> None:
    slow = {**FAST_ENGINE, "timing": {"speedup": 0.5}}  # each forward pass takes ~35 ms
    embed = ModelConfig(kind="embedding", backend="mock", decode_workers=2, engine_args=slow)
    async with serving_tree(mode="aggregated", decode_workers=1, models=[embed]) as tree:
        texts = [f"sentence number {i}" for i in range(48)]
        async with httpx.AsyncClient(base_url=tree.url, timeout=60) as http:

            async def embed_all() -> list[list[float]]:
                vectors: list[list[float]] = [[] for _ in texts]

                async def one(i: int) -> None:
                    body = {"model": "mock-embedding", "input": texts[i]}
                    response = await http.post("/v1/embeddings", json=body)
                    assert response.status_code == 200, response.text
                    vectors[i] = response.json()["data"][0]["embedding"]

                async with anyio.create_task_group() as tg:
                    for i in range(len(texts)):
                        tg.start_soon(one, i)
                return vectors

            expected = await embed_all()
            victim = (await tree.engine_stats("mock-embedding/decode-0")).pid
            async with anyio.create_task_group() as tg:
                results: list[list[list[float]]] = []

                async def run() -> None:
                    results.append(await embed_all())

                tg.start_soon(run)
                await wait_until(
                    lambda: (
                        tree.serving.model("mock-embedding")
                        .table.workers["mock-embedding/decode-0"]
                        .active
                        > 0
                    ),
                    timeout=10,
                )
                os.kill(victim, signal.SIGKILL)
            assert results == [expected]
            metrics = (await http.get("/metrics")).text
        moved = sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("actorserve_frontend_model_migration_total{")
            and 'model="mock-embedding"' in line
        )
        assert moved > 0
