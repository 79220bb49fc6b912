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
#: The most choices one request may ask for (OpenAI's bound on ``n``), over all its prompts.
MAX_CHOICES = 128
#: The most prompts one completion request may hold.
MAX_PROMPTS = 64
#: The most tokens a ``logit_bias`` may name.
_MAX_BIASED = 1024


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
#: A token id as a JSON object's key (``logit_bias``): a decimal number without a sign.
TokenIdKey = Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,9})$")]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
_ONE = Field(min_length=1, max_length=1)


_USE_RESPONSE_FORMAT = "only null: not supported, use response_format, regex or ebnf"


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: Annotated[
        bool, _Accepts("only false: usage comes once, after the last choice's chunk", (False,))
    ] = False


class TextContentPart(_Request):
    type: Literal["text"]
    text: Str


class FunctionCallMessage(_Request):
    name: Str
    arguments: Str  # JSON text, as OpenAI sends it


class ToolCallMessage(_Request):
    """A call an assistant made, in a conversation's history."""

    id: Str
    type: Literal["function"] = "function"
    function: FunctionCallMessage


class ChatMessage(_Request):
    """One message; content is text or a list of text parts (images are not supported).

    An assistant's message may hold the ``tool_calls`` it made (its content then may be null); a
    ``tool`` message answers one of them (``tool_call_id``). Calls in another role's message go
    into the prompt all the same (nothing a client sends is dropped)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Str | list[TextContentPart] | None = None
    name: Str | None = None
    tool_calls: Annotated[
        list[ToolCallMessage] | None,
        Field(description="The calls an assistant made (on any role, they are shown as made)."),
    ] = None
    tool_call_id: Annotated[Str | None, Field(description="The call a tool's message answers.")] = (
        None
    )

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


_FUNCTION_NAME = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.:-]{1,64}$")]


class FunctionDefinition(_Request):
    name: _FUNCTION_NAME
    description: Str | None = None
    parameters: Annotated[
        dict[str, Any] | None,
        Field(description="The arguments' JSON schema (an object's); none: no arguments."),
    ] = None
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: _FUNCTION_NAME


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


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
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0)] | None = None
    logit_bias: Annotated[
        Annotated[
            dict[TokenIdKey, Annotated[float, Field(ge=-100.0, le=100.0)]],
            Field(max_length=_MAX_BIASED, json_schema_extra={"additionalProperties": False}),
        ]
        | None,
        _Accepts(
            f"token ids of the model's vocabulary (as strings), at most {_MAX_BIASED}, each to a "
            "bias from -100 to 100 added to its logit (-100 bans it)"
        ),
    ] = None
    response_format: ResponseFormat | None = None
    regex: Annotated[
        Str | None,
        Field(description="SGLang's extension: the output matches this regular expression."),
    ] = None
    ebnf: Annotated[
        Str | None,
        Field(description="SGLang's extension: the output follows this EBNF grammar."),
    ] = None
    stream: bool = False
    stream_options: Annotated[
        StreamOptions | None, Field(description="Only with `stream` true.")
    ] = None
    user: Str | None = None
    # Fields of vLLM's and SGLang's APIs that would change the answer, which we do not implement:
    # refused, never ignored.
    use_beam_search: Annotated[
        bool, _Accepts("only false: beam search is not supported", (False,))
    ] = False
    skip_special_tokens: Annotated[
        bool, _Accepts("only true: special tokens are never shown", (True,))
    ] = True
    include_stop_str_in_output: Annotated[
        bool, _Accepts("only false: a stop string is never shown", (False,))
    ] = False
    return_hidden_states: Annotated[
        bool, _Accepts("only false: hidden states are not returned", (False,))
    ] = False
    guided_json: Annotated[Any, _Accepts(_USE_RESPONSE_FORMAT, (None,))] = None
    guided_regex: Annotated[Any, _Accepts(_USE_RESPONSE_FORMAT, (None,))] = None
    guided_choice: Annotated[Any, _Accepts(_USE_RESPONSE_FORMAT, (None,))] = None
    guided_grammar: Annotated[Any, _Accepts(_USE_RESPONSE_FORMAT, (None,))] = None
    structured_outputs: Annotated[Any, _Accepts(_USE_RESPONSE_FORMAT, (None,))] = None
    prompt_logprobs: Annotated[
        Any, _Accepts("only null: prompt logprobs come with `echo` on /v1/completions", (None,))
    ] = None
    truncate_prompt_tokens: Annotated[
        Any, _Accepts("only null: prompts are never truncated", (None,))
    ] = None
    lora_path: Annotated[Any, _Accepts("only null: LoRA adapters are not supported", (None,))] = (
        None
    )
    json_schema: Annotated[Any, _Accepts(_USE_RESPONSE_FORMAT, (None,))] = None
    bad_words: Annotated[
        Any, _Accepts("only null: not supported, use logit_bias to ban tokens", (None,))
    ] = None
    allowed_token_ids: Annotated[
        Any, _Accepts("only null: not supported, use logit_bias to ban tokens", (None,))
    ] = None
    custom_logit_processor: Annotated[
        Any, _Accepts("only null: custom logit processors are not supported", (None,))
    ] = None

    @field_validator("regex")
    @classmethod
    def _one_grammar_regex(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None:
            _one_grammar(info, "regex")
        return value

    @field_validator("ebnf")
    @classmethod
    def _one_grammar_ebnf(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None:
            _one_grammar(info, "ebnf")
        return value

    @field_validator("stream_options")
    @classmethod
    def _options_need_stream(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            # OpenAI's own refusal: the options of a stream that does not exist.
            raise PydanticCustomError("invalid_value", "stream_options needs stream set to true")
        return value


def _one_grammar(info: ValidationInfo, field: str) -> None:
    """Refuses a second constraint on the output (``response_format`` or ``regex`` before)."""
    fmt = info.data.get("response_format")
    if info.data.get("regex") is not None or (fmt is not None and fmt.type != "text"):
        raise PydanticCustomError(
            "invalid_value",
            f"at most one of response_format (json), regex and ebnf, not {field} too",
        )


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
    functions: Annotated[
        Any, _Accepts("only null: the deprecated function API is not supported, use tools", (None,))
    ] = None
    function_call: Annotated[
        Any, _Accepts("only null: the deprecated function API is not supported, use tools", (None,))
    ] = None
    audio: Annotated[Any, _Accepts("only null: audio output is not supported", (None,))] = None
    modalities: Annotated[
        list[Literal["text"]] | None,
        _Accepts('only null or ["text"]: other modalities are not supported'),
    ] = None
    web_search_options: Annotated[
        Any, _Accepts("only null: web search is not supported", (None,))
    ] = None
    echo: Annotated[
        bool, _Accepts("only false: echoing the last message is not supported", (False,))
    ] = False
    continue_final_message: Annotated[
        bool, _Accepts("only false: the last message is never continued", (False,))
    ] = False
    add_generation_prompt: Annotated[
        bool, _Accepts("only true: the generation prompt is always added", (True,))
    ] = True
    chat_template: Annotated[
        Any, _Accepts("only null: the model's own chat template is used", (None,))
    ] = None
    best_of: Annotated[
        int | None, _Accepts("only null or 1: best_of is for /v1/completions", (None, 1))
    ] = None
    tools: Annotated[
        list[ToolDefinition] | None,
        Field(
            max_length=128,
            description="Functions the model may call; the server needs a `--tool-call-parser` "
            "(else 400, unless `tool_choice` is `none`).",
        ),
    ] = None
    tool_choice: Annotated[
        Literal["none", "auto", "required"] | NamedToolChoice | None,
        Field(
            description="`auto` (the default with tools), `none`, `required` (at least one "
            "call) or a named function (a call of it); `required` and a named function are "
            "enforced by constrained decoding."
        ),
    ] = None
    parallel_tool_calls: Annotated[
        bool,
        Field(description="false: at most one call (the first; forced calls: exactly one)."),
    ] = True
    separate_reasoning: Annotated[
        bool,
        Field(
            description="SGLang's extension: false leaves the reasoning in `content` (no "
            "`reasoning_content`), where the server has a `--reasoning-parser`."
        ),
    ] = True

    @field_validator("tool_choice")
    @classmethod
    def _choice_of_tools(
        cls, value: str | NamedToolChoice | None, info: ValidationInfo
    ) -> str | NamedToolChoice | None:
        tools = info.data.get("tools") or []
        if isinstance(value, NamedToolChoice):
            if value.function.name not in {tool.function.name for tool in tools}:
                raise PydanticCustomError(
                    "invalid_value",
                    "tool_choice names a function that is not in tools: {name}",
                    {"name": value.function.name},
                )
        elif value == "required" and not tools:
            raise PydanticCustomError("invalid_value", "tool_choice required needs tools")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise PydanticCustomError("invalid_value", "top_logprobs needs logprobs set to true")
        return value


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a prompt, or a batch of them, as texts or token ids."""

    prompt: Annotated[
        Str
        | TokenIds
        | Annotated[list[Str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)],
        _Accepts(
            f"a string, a non-empty list of token ids, or a list of 1 to {MAX_PROMPTS} of one "
            "of those (a batch: n choices each)"
        ),
    ]
    echo: bool = False
    logprobs: Annotated[
        int | None,
        Field(
            ge=0,
            le=5,
            description="How many most likely tokens to return per token "
            "(with the chosen one's); with `echo`, the prompt's tokens' too.",
        ),
    ] = None
    best_of: Annotated[
        int | None,
        Field(
            ge=1,
            le=20,
            description="Generate this many choices per prompt (at least `n`) and return the `n` "
            "of highest log probability; not with `stream`.",
        ),
    ] = None
    suffix: Annotated[
        Str | None, _Accepts("only null or empty: suffix is not supported yet", (None, ""))
    ] = None

    @field_validator("prompt")
    @classmethod
    def _choices_per_batch(cls, value: Any, info: ValidationInfo) -> Any:
        if len(_batch(value)) * info.data.get("n", 1) > MAX_CHOICES:
            raise PydanticCustomError(
                "invalid_value", f"at most {MAX_CHOICES} choices: n times the prompts"
            )
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is None:
            return value
        if value < info.data.get("n", 1):
            raise PydanticCustomError("invalid_value", "best_of must be at least n")
        if value > 1 and info.data.get("stream"):
            raise PydanticCustomError("invalid_value", "best_of above 1 cannot be streamed")
        if len(_batch(info.data.get("prompt", ""))) * value > MAX_CHOICES:
            raise PydanticCustomError(
                "invalid_value", f"at most {MAX_CHOICES} choices: best_of times the prompts"
            )
        return value

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the batch (one, for a single prompt)."""
        return _batch(self.prompt)


def _batch(prompt: str | list[Any]) -> list[str | list[int]]:
    """A completion's prompt as a batch: a single prompt is a batch of one."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


# --- responses (documentation only) ------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: ResponseFunctionCall


class ResponseMessage(BaseModel):
    """The answer: ``content`` is null when the answer is only tool calls; ``tool_calls`` and
    ``reasoning_content`` (with a ``--reasoning-parser``) are there only when there are some."""

    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None


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
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape: ``top_logprobs`` maps token texts to logprobs, the chosen one's
    included; ``text_offset`` is where each token's text starts in the choice's text. With
    ``echo``, the prompt's tokens come first, the first with null (nothing came before it)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
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
