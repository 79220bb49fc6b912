"""Pydantic models of the OpenAI request bodies (validated once per request) and of the responses.

The request models are strict (a string is not a number, a bool is not a float) and ignore
unknown fields, as OpenAI-compatible servers do. Every string must be valid Unicode: a lone
surrogate, which JSON allows, could neither be tokenised nor sent back in an error.

The response models only document the API (OpenAPI schema, schemathesis' conformance checks); the
responses themselves are encoded with msgspec (``_chunks.py``), which these models must match.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

__all__ = [
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatMessage",
    "CompletionRequest",
    "CompletionResponse",
    "ErrorResponse",
    "ModelCard",
    "ModelList",
]

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_UINT64_MAX = 2**64 - 1
#: Bounds for token counts: large enough for any context, small enough for every wire format.
_MAX_TOKENS = 2**31 - 1


def _unicode(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("string is not valid Unicode (lone surrogate)") from None
    return value


Str = Annotated[str, AfterValidator(_unicode)]
TokenCount = Annotated[int, Field(ge=1, le=_MAX_TOKENS)]
TokenId = Annotated[int, Field(ge=0, le=2**32 - 1)]
Seed = Annotated[int, Field(ge=_INT64_MIN, le=_UINT64_MAX)]
Stop = Str | Annotated[list[Str], Field(max_length=16)] | None


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False


class TextContentPart(_Request):
    type: Literal["text"]
    text: Str


class ChatMessage(_Request):
    """One message; content is text or a list of text parts (images are not supported)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Str | list[TextContentPart] | None = None
    name: Str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JsonSchemaFormat(_Request):
    name: Str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Request):
    """Fields shared by chat and completions (OpenAI's, plus vLLM/SGLang's usual extensions)."""

    model: Str
    max_tokens: TokenCount | None = None
    min_tokens: Annotated[int, Field(ge=0, le=_MAX_TOKENS)] | None = None
    stop: Stop = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    ignore_eos: bool = False
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=_INT64_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Seed | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Str | None = None


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: Str | list[TokenId] | list[Str] | list[list[TokenId]]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    best_of: Annotated[int, Field(ge=1, le=128)] | None = None
    suffix: Str | None = None


# --- responses (documentation only) ------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ResponseMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail
