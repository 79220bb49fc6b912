"""Real models of the other kinds, served (hf backend, engines in child processes):
all-MiniLM-L6-v2 through ``/v1/embeddings`` against sentence-transformers' own vectors, and a
tiny diffusers pipeline through ``/v1/images/generations``."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from actors.serving import ModelConfig
from actors.serving.engines import find_minilm
from actors.testing import wait_until
from tests.helpers.serving import Tree, serving_tree, with_openai

EMBEDDER = "all-minilm-l6-v2"
PAINTER = "tiny-diffusion"
TEXTS = ["A man is eating food.", "The new movie is awesome!", "A man is eating food."]


@pytest.fixture(scope="module")
def reference() -> Any:
    """sentence-transformers' own model and vectors of :data:`TEXTS`."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(find_minilm()), device="cpu")
    return model, model.encode(TEXTS)


@pytest.fixture
async def tree() -> AsyncIterator[Tree]:
    painter = ModelConfig(kind="image", backend="hf", decode_workers=1)
    async with serving_tree(
        kind="embedding", backend="hf", decode_workers=1, models=[painter], ready_timeout=120
    ) as tree:
        yield tree


def _cosines(a: Any, b: Any) -> Any:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


async def test_embeddings_equal_sentence_transformers_own(tree: Tree, reference: Any) -> None:
    model, expected = reference
    ids = [model.tokenizer(text)["input_ids"] for text in TEXTS]

    def embed(client: openai.OpenAI) -> list[Any]:
        return [
            client.embeddings.create(model=EMBEDDER, input=TEXTS[0], encoding_format="float"),
            client.embeddings.create(model=EMBEDDER, input=TEXTS, encoding_format="float"),
            client.embeddings.create(model=EMBEDDER, input=TEXTS),  # base64, decoded
            client.embeddings.create(model=EMBEDDER, input=ids),
            client.embeddings.create(model=EMBEDDER, input=ids[1]),
        ]

    single, batch, packed, tokens, one_ids = await with_openai(tree, embed)
    assert _cosines(single.data[0].embedding, expected[0]) >= 0.9999
    for response in (batch, packed, tokens):
        vectors = [d.embedding for d in response.data]
        assert min(_cosines(vectors, expected)) >= 0.9999
    assert _cosines(one_ids.data[0].embedding, expected[1]) >= 0.9999
    assert batch.usage.prompt_tokens == sum(len(i) for i in ids)

    async with httpx.AsyncClient(base_url=tree.url) as http:
        too_long = await http.post("/v1/embeddings", json={"model": EMBEDDER, "input": "x " * 400})
        assert too_long.status_code == 400
        assert "256" in too_long.json()["error"]["message"]
        cut = await http.post(
            "/v1/embeddings", json={"model": EMBEDDER, "input": "x", "dimensions": 128}
        )
        assert cut.status_code == 400
        assert "384" in cut.json()["error"]["message"]

        async def exported() -> bool:
            metrics = (await http.get("/metrics")).text
            return "actorserve_worker_embedding_batch_size_count{" in metrics

        await wait_until(exported, timeout=30)


async def test_images_are_pngs_of_their_size_and_seed(tree: Tree) -> None:
    body = {"prompt": "a lighthouse", "size": "64x32", "num_inference_steps": 3, "seed": 11}

    def paint(client: openai.OpenAI) -> tuple[Any, Any]:
        options = {k: v for k, v in body.items() if k != "prompt"}
        twice = client.images.generate(
            model=PAINTER, prompt="a lighthouse", n=2, extra_body=options
        )
        again = client.images.generate(model=PAINTER, prompt="a lighthouse", extra_body=options)
        return twice, again

    twice, again = await with_openai(tree, paint)
    first = base64.b64decode(twice.data[0].b64_json)
    image = Image.open(io.BytesIO(first))
    assert image.format == "PNG" and image.size == (64, 32)
    assert first == base64.b64decode(again.data[0].b64_json)
    assert twice.data[1].b64_json != twice.data[0].b64_json


async def test_a_client_that_leaves_stops_its_image_between_steps(tree: Tree) -> None:
    worker = f"{PAINTER}/decode-0"
    before = (await tree.engine_stats(worker)).counters["image_steps"]
    steps = 999
    body = {"model": PAINTER, "prompt": "a long one", "size": "64x64", "seed": 3}
    payload = json.dumps({**body, "num_inference_steps": steps, "stream": True}).encode()
    assert tree.serving.port is not None
    seen = 0
    # A raw connection the test closes itself: the client leaves after three steps.
    async with await anyio.connect_tcp("127.0.0.1", tree.serving.port) as sock:
        await sock.send(
            b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        received = b""
        while seen < 3:
            received += await sock.receive()
            seen = received.count(b'"image_generation.progress"')
        assert received.startswith(b"HTTP/1.1 200")

    async def idle() -> bool:
        return (await tree.engine_stats(worker)).engine_in_flight == 0

    await wait_until(idle, timeout=60)
    ran = (await tree.engine_stats(worker)).counters["image_steps"] - before
    assert seen <= ran < steps // 2
