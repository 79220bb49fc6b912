"""The mock engine's embedding model (``kind="embedding"``): deterministic vectors.

An embed request runs through the scheduler like a prompt with no token to generate: it is
batched, charged the timing model's prefill cost, aborted and shut down like any other. Its
stream then answers with the vector instead of the (empty) tokens: a pure function of the token
ids (a normal draw seeded by their xxh3 hash, L2-normalised), as little-endian float32 bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from actors.serving.engines._embed_options import check_dimensions
from protocols.engine import EngineOutput, PreprocessedRequest, Usage
from protocols.errors import InvalidRequest

from ._request import EngineStream, MockRequest, StreamHost

__all__ = ["EmbedStream", "check_embed", "mock_embedding"]


def check_embed(request: PreprocessedRequest, kind: str, dim: int) -> None:
    """Refuse a request the engine's ``kind`` does not serve (``InvalidRequest``): an embed
    request on another kind, any other on an embedding engine, or ``dimensions`` other than the
    model's (its vectors cannot be shortened)."""
    embed = request.embed
    if kind != "embedding":
        if embed is not None:
            raise InvalidRequest(f"this engine serves {kind} models, not embeddings")
        return
    if embed is None:
        raise InvalidRequest("this engine serves embedding models: the request needs 'embed'")
    check_dimensions(embed, dim)


def mock_embedding(token_ids: Sequence[int], dim: int) -> bytes:
    """The vector of ``token_ids``: ``dim`` little-endian float32 components of unit length."""
    seed = xxhash.xxh3_64_intdigest(np.asarray(token_ids, dtype="<i8").tobytes())
    vector = np.random.default_rng(seed).standard_normal(dim)
    vector /= np.linalg.norm(vector)
    return vector.astype("<f4").tobytes()


class EmbedStream(EngineStream):
    """An embed request's stream: the scheduler's final (token-less) output becomes one with
    the vector; a cancelled or failed request ends as any other."""

    def __init__(self, req: MockRequest | None, host: StreamHost | None, *, dim: int) -> None:
        super().__init__(req, host)
        self._dim = dim

    async def __anext__(self) -> EngineOutput:
        while True:
            out = await super().__anext__()
            if out.finish_reason is not None:
                break  # anything before the end would be a prompt-logprobs output: dropped
        req = self._req
        assert req is not None
        usage = Usage(prompt_tokens=req.prompt_len, completion_tokens=0)
        if out.finish_reason == "cancelled":
            return EngineOutput(finish_reason="cancelled", usage=usage)
        vector = mock_embedding(req.request.token_ids, self._dim)
        return EngineOutput(embedding=vector, finish_reason="stop", usage=usage)
