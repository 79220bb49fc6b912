"""Pydantic models of the OpenAI request bodies (validated once per request) and of the responses.

The request models are strict (a string is not a number, a bool is not a float) and ignore
unknown fields, as OpenAI-compatible servers do. Every string must be valid Unicode: a lone
surrogate, which JSON allows, could neither be tokenised nor sent back in an error.

They are the one statement of what a request may hold: the door validates with them and the
OpenAPI schema is theirs, so a field that is not fully implemented yet says what it accepts here
(:class:`_Accepts`), never in an endpoint's own check. A whole number written with a fraction or
an exponent (``8.0``, ``1e3``) is an integer, as JSON Schema says: the door decodes it as one.

The response models only document the API (OpenAPI schema, schemathesis' conformance checks); the
responses themselves are encoded with msgspec (``_chunks.py``), which these models must match.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import PydanticCustomError, core_schema

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


@dataclasses.dataclass(frozen=True)
class _Accepts:
    """What a field accepts, said once for validation and schema alike: ``only`` (when given)
    restricts it to those values (the schema's ``enum``), and every refusal, a value of the wrong
    type included, answers ``says`` (the schema's description)."""

    says: str
    only: tuple[object, ...] = ()

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_wrap_validator_function(self._validate, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        json_schema = handler(schema)
        if self.only:
            json_schema["enum"] = list(self.only)
        json_schema["description"] = self.says
        return json_schema

    def _validate(self, value: Any, inner: ValidatorFunctionWrapHandler) -> Any:
        try:
            value = inner(value)
        except ValidationError:
            raise PydanticCustomError("unsupported_value", self.says) from None
        if self.only and value not in self.only:
            raise PydanticCustomError("unsupported_value", self.says)
        return value


Str = Annotated[str, AfterValidator(_unicode)]
TokenCount = Annotated[int, Field(ge=1, le=_MAX_TOKENS)]
TokenId = Annotated[int, Field(ge=0, le=2**32 - 1)]
Seed = Annotated[int, Field(ge=_INT64_MIN, le=_UINT64_MAX)]
Stop = Str | Annotated[list[Str], Field(max_length=16)] | None
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
_ONE = Field(min_length=1, max_length=1)


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
    n: Annotated[int, _Accepts("only 1: n > 1 is not supported yet", (1,))] = 1
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
    logprobs: bool | None = False
    top_logprobs: Annotated[
        int | None,
        Field(
            ge=0,
            le=20,
            description="How many most likely tokens to return per token: "
            "more than 0 needs `logprobs` true.",
        ),
    ] = None
    response_format: ResponseFormat | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise PydanticCustomError("invalid_value", "top_logprobs needs logprobs set to true")
        return value


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: Annotated[
        Str | TokenIds | Annotated[list[Str], _ONE] | Annotated[list[TokenIds], _ONE],
        _Accepts(
            "a string, a non-empty list of token ids, or a list of one of those: batched "
            "prompts are not supported yet"
        ),
    ]
    echo: bool = False
    logprobs: Annotated[
        int | None,
        Field(
            ge=0,
            le=5,
            description="How many most likely tokens to return per token "
            "(with the chosen one's): not with `echo`, the prompt's are not supported yet.",
        ),
    ] = None
    best_of: Annotated[
        int | None, _Accepts("only null or 1: best_of > 1 is not supported yet", (None, 1))
    ] = None
    suffix: Annotated[
        Str | None, _Accepts("only null or empty: suffix is not supported yet", (None, ""))
    ] = None

    @field_validator("logprobs")
    @classmethod
    def _no_prompt_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("echo"):
            raise PydanticCustomError(
                "unsupported_value", "logprobs with echo: prompt logprobs are not supported yet"
            )
        return value


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


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None = None


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape: ``top_logprobs`` maps token texts to logprobs, the chosen one's
    included; ``text_offset`` is where each token's text starts in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
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
