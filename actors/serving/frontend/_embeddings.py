"""``POST /v1/embeddings``: the request's model, its engine requests, and the response.

Each input is one engine request (an ``embed`` request of its token ids); the engine batches
requests that arrive together, whichever HTTP request they came from. Engines answer with the
vector as little-endian float32 bytes, which is exactly what ``encoding_format: base64`` sends,
so base64 answers are never decoded to floats; ``float`` answers are.
"""

from __future__ import annotations

import base64
import secrets
from functools import partial
from typing import Annotated, Literal

import msgspec
import numpy as np
from pydantic import BaseModel, Field

from protocols.engine import EmbedOptions, EngineOutput, PreprocessedRequest

from ._backend import ModelInfo
from ._errors import invalid
from ._mapping import context_exceeded, tokenize
from ._openai_types import Str, TokenIds, _Request

__all__ = [
    "EMBEDDINGS_PATH",
    "EmbeddingRequest",
    "EmbeddingResponse",
    "embedding_body",
    "embedding_requests",
]

EMBEDDINGS_PATH = "/v1/embeddings"
#: The most inputs one request may hold (OpenAI's bound).
MAX_INPUTS = 2048


class EmbeddingRequest(_Request):
    """``POST /v1/embeddings``: one input or a batch, as texts or token ids."""

    model: Str
    input: Annotated[
        Str
        | TokenIds
        | Annotated[list[Str], Field(min_length=1, max_length=MAX_INPUTS)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)],
        Field(
            description=f"A text, a list of token ids, or a list of 1 to {MAX_INPUTS} of one of "
            "those; each is embedded on its own."
        ),
    ]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[
        int | None,
        Field(
            ge=1,
            le=2**31 - 1,  # any model's size, and a number every wire format carries
            description="The vector's size; only what the model gives, unless it is "
            "trained to be cut (the engine refuses others).",
        ),
    ] = None
    user: Str | None = None

    def inputs(self) -> list[str | list[int]]:
        value = self.input
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            return [value]
        return list(value)  # type: ignore[arg-type]


class EmbeddingData(BaseModel):
    object: Literal["embedding"]
    embedding: list[float] | str
    index: int


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"]
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


async def embedding_requests(info: ModelInfo, body: EmbeddingRequest) -> list[PreprocessedRequest]:
    """One ``embed`` engine request per input, each within the model's context."""
    rid = f"embd-{secrets.token_hex(16)}"
    options = EmbedOptions(dimensions=body.dimensions)
    requests = []
    for index, value in enumerate(body.inputs()):
        if isinstance(value, str):
            ids = await tokenize(partial(info.tokenizer.encode, value), len(value), info, "input")
        else:
            ids = list(value)
        if not ids:
            raise invalid("an input of no tokens has no embedding", "input")
        if len(ids) > info.context_length:
            raise context_exceeded(info.context_length, len(ids), "input", None)
        requests.append(
            PreprocessedRequest(rid=f"{rid}-{index}", token_ids=ids, model=info.name, embed=options)
        )
    return requests


class _Data(msgspec.Struct):
    embedding: list[float] | str
    index: int
    object: str = "embedding"


class _Usage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class _Body(msgspec.Struct):
    data: list[_Data]
    model: str
    usage: _Usage
    object: str = "list"


def embedding_body(
    model: str, outputs: list[EngineOutput], encoding: Literal["float", "base64"]
) -> bytes:
    """The JSON response from each input's one engine output, in the inputs' order."""
    data = []
    tokens = 0
    for index, out in enumerate(outputs):
        if out.embedding is None:
            raise ValueError(f"the engine answered input {index} without an embedding")
        vector: list[float] | str
        if encoding == "base64":
            vector = base64.b64encode(out.embedding).decode()
        else:
            vector = np.frombuffer(out.embedding, dtype="<f4").tolist()
        data.append(_Data(vector, index))
        tokens += out.usage.prompt_tokens if out.usage is not None else 0
    return msgspec.json.encode(_Body(data, model, _Usage(tokens, tokens)))
