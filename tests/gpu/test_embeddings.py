"""An embedding model on real SGLang (``is_embedding``; the suite's Llama shape with dummy
weights, last-token pooling): ``/v1/embeddings`` through the `openai` client, texts and token
ids, one and several, float and base64."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest

from tests.gpu.conftest import MODEL, openai_client, sglang_args
from tests.helpers.serving import Tree, serving_tree


@pytest.fixture(scope="module")
async def tree() -> AsyncIterator[Tree]:
    async with serving_tree(
        ready_timeout=900,
        backend="sglang",
        kind="embedding",
        decode_workers=1,
        tokenizer=str(MODEL),
        health_idle_after=1.0,
        health_timeout=30.0,
        stall_timeout=120.0,
        engine_args=sglang_args(0.3),
    ) as tree:
        yield tree


def _unit(vector: list[float]) -> np.ndarray:
    array = np.asarray(vector, dtype=np.float64)
    return array / np.linalg.norm(array)


async def test_embeddings_of_texts_and_token_ids(tree: Tree) -> None:
    texts = [
        "The capital of France is Paris.",
        "A second sentence.",
        "The capital of France is Paris.",
    ]
    async with openai_client(tree) as client:
        model = (await client.models.list()).data[0].id
        one = await client.embeddings.create(model=model, input=texts[0], encoding_format="float")
        several = await client.embeddings.create(model=model, input=texts, encoding_format="float")
        packed = await client.embeddings.create(model=model, input=texts)  # base64, decoded
        ids = tree.serving.model().tokenizer.encode(texts[1])
        by_ids = await client.embeddings.create(model=model, input=[ids], encoding_format="float")
    hidden = 576  # the suite model's hidden size
    vectors = [_unit(d.embedding) for d in several.data]
    assert all(len(d.embedding) == hidden for d in several.data)
    assert float(vectors[0] @ vectors[2]) > 0.999  # the same text, in one batch
    assert float(vectors[0] @ _unit(one.data[0].embedding)) > 0.999  # alone or batched
    assert float(vectors[0] @ vectors[1]) < 0.999
    assert float(vectors[1] @ _unit(by_ids.data[0].embedding)) > 0.999  # text or its ids
    for a, b in zip(several.data, packed.data, strict=True):
        assert float(_unit(a.embedding) @ _unit(b.embedding)) > 0.9999
    assert several.usage.prompt_tokens == sum(
        len(tree.serving.model().tokenizer.encode(t)) for t in texts
    )
