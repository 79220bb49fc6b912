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
        engine_args=sglang_args(0.3, enable_deterministic_inference=True),
    ) as tree:
        yield tree


def _gap(a: list[float], b: list[float]) -> float:
    return float(np.linalg.norm(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)))


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
    vectors = [d.embedding for d in several.data]
    assert all(len(v) == hidden for v in vectors)
    # Random weights put every text's vector close together, so closeness is judged against
    # the gap between two different texts (batch-invariant kernels make the others exact).
    apart = _gap(vectors[0], vectors[1])
    assert apart > 0
    assert _gap(vectors[0], vectors[2]) <= apart / 100  # the same text, in one batch
    assert _gap(vectors[0], one.data[0].embedding) <= apart / 100  # alone or batched
    assert _gap(vectors[1], by_ids.data[0].embedding) <= apart / 100  # text or its ids
    for a, b in zip(several.data, packed.data, strict=True):
        assert _gap(a.embedding, b.embedding) <= apart / 100  # float or base64
    assert several.usage.prompt_tokens == sum(
        len(tree.serving.model().tokenizer.encode(t)) for t in texts
    )
