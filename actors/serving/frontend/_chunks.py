"""Response bodies and SSE frames, encoded with msgspec.

This is the per-chunk hot path: no pydantic here. A renderer is built once per choice (the
request's id, model, created; the choice's index) and turns the choice's text deltas into
ready-to-send SSE frames; the shapes match OpenAI's and the documentation models in
``_openai_types.py``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Generic, TypeVar

import msgspec

from protocols.engine import Usage

from ._parsers import OutputParser, ParsedDelta, ToolCall, ToolCallDelta

__all__ = [
    "DONE_FRAME",
    "ChatRenderer",
    "CompletionRenderer",
    "Renderer",
    "TokenLogprob",
    "TopLogprob",
    "error_frame",
]

_encode = msgspec.json.encode

DONE_FRAME = b"data: [DONE]\n\n"


class _PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class _Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: _PromptTokensDetails | None = None


def _usage(usage: Usage) -> _Usage:
    details = None if usage.cached_tokens is None else _PromptTokensDetails(usage.cached_tokens)
    return _Usage(usage.prompt_tokens, usage.completion_tokens, usage.total_tokens, details)


# Logprobs -----------------------------------------------------------------------------------


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct):
    """One token's logprob and its alternatives, in chat's shape (which completions' legacy
    shape is made from). Only an echoed prompt's first token has no logprob (``None``); its
    special tokens have no ``bytes``, as they take no room in the echoed text."""

    token: str
    logprob: float | None
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class _ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob]
    refusal: None = None


class _CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


# Chat ---------------------------------------------------------------------------------------


class _ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    # With an output parser (see _parsers): the reasoning and the calls, only where there are.
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class _ChatChunkChoice(msgspec.Struct):
    index: int
    delta: _ChatDelta
    logprobs: _ChatLogprobs | None = None
    finish_reason: str | None = None


class _ChatChunk(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[_ChatChunkChoice]
    # UNSET: no "usage" key at all (the client did not ask); None: "usage": null, as OpenAI
    # sends on every chunk but the last when stream_options.include_usage is set.
    usage: _Usage | msgspec.UnsetType | None = msgspec.UNSET


class _ChatMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None  # null when the answer is only tool calls
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class _ChatChoice(msgspec.Struct):
    index: int
    message: _ChatMessage
    logprobs: _ChatLogprobs | None = None
    finish_reason: str | None = None


class _ChatCompletion(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[_ChatChoice]
    usage: _Usage


# Completions --------------------------------------------------------------------------------


class _CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: _CompletionLogprobs | None = None
    finish_reason: str | None = None


class _CompletionChunk(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[_CompletionChoice]
    usage: _Usage | msgspec.UnsetType | None = msgspec.UNSET


class _Completion(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[_CompletionChoice]
    usage: _Usage


def _frame(body: bytes) -> bytes:
    # msgspec escapes newlines inside strings, so one JSON document is always one "data:" line.
    return b"data: " + body + b"\n\n"


#: Stands for the text when a renderer encodes its frame template (any text would do).
_MARK = "\x00"
_ENCODED_MARK = _encode(_MARK)


#: A renderer's choice in a non-streaming body.
C = TypeVar("C", bound=msgspec.Struct)


class Renderer(abc.ABC, Generic[C]):
    """Renders one choice's stream frames and its part of the non-streaming body."""

    __slots__ = ("_head", "_tail", "created", "id", "include_usage", "index", "model")

    def __init__(
        self, id: str, model: str, created: int, *, include_usage: bool, index: int = 0
    ) -> None:
        self.id = id
        self.model = model
        self.created = created
        self.include_usage = include_usage
        self.index = index
        # The frame of a text delta (no finish reason) around its text, encoded once: each delta
        # then encodes only its text, with the same bytes as encoding the whole chunk.
        self._head, _, self._tail = self._frame_of(_MARK).rpartition(_ENCODED_MARK)

    @abc.abstractmethod
    def _frame_of(self, text: str) -> bytes:
        """The frame of a delta with (non-empty) ``text`` and no finish reason."""

    @abc.abstractmethod
    def start(self) -> bytes | None:
        """The frame that opens a stream, if the API has one."""

    @abc.abstractmethod
    def delta(
        self,
        text: str,
        finish_reason: str | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> bytes:
        """A frame with new text, and the finish reason on the last one; with the logprobs of
        the tokens since the last frame when the request asked for them."""

    @abc.abstractmethod
    def usage(self, usage: Usage) -> bytes:
        """The usage frame (``choices: []``) sent after the last one when asked for."""

    @abc.abstractmethod
    def choice(
        self,
        index: int,
        text: str,
        finish_reason: str,
        logprobs: list[TokenLogprob] | None = None,
    ) -> C:
        """The choice of index ``index`` in a non-streaming response (``logprobs``: every
        token's, when asked for)."""

    @abc.abstractmethod
    def body(self, choices: Sequence[C], usage: Usage) -> bytes:
        """The whole non-streaming response of ``choices``."""

    def _chunk_usage(self) -> msgspec.UnsetType | None:
        return None if self.include_usage else msgspec.UNSET


class ChatRenderer(Renderer[_ChatChoice]):
    """``chat.completion.chunk`` frames and the ``chat.completion`` body."""

    __slots__ = ()

    def start(self) -> bytes | None:
        choice = _ChatChunkChoice(self.index, _ChatDelta(role="assistant", content=""))
        return self._chunk(choice)

    def delta(
        self,
        text: str,
        finish_reason: str | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> bytes:
        if text and finish_reason is None and logprobs is None:
            return self._head + _encode(text) + self._tail  # the usual delta (see __init__)
        delta = _ChatDelta(content=text) if text else _ChatDelta()
        # Chunks without new tokens (the last one, often) say null, as OpenAI's do.
        chat_logprobs = _ChatLogprobs(logprobs) if logprobs else None
        return self._chunk(_ChatChunkChoice(self.index, delta, chat_logprobs, finish_reason))

    def _frame_of(self, text: str) -> bytes:
        return self._chunk(_ChatChunkChoice(self.index, _ChatDelta(content=text)))

    def _chunk(self, choice: _ChatChunkChoice) -> bytes:
        chunk = _ChatChunk(
            self.id,
            "chat.completion.chunk",
            self.created,
            self.model,
            [choice],
            self._chunk_usage(),
        )
        return _frame(_encode(chunk))

    def usage(self, usage: Usage) -> bytes:
        chunk = _ChatChunk(
            self.id, "chat.completion.chunk", self.created, self.model, [], _usage(usage)
        )
        return _frame(_encode(chunk))

    def choice(
        self,
        index: int,
        text: str,
        finish_reason: str,
        logprobs: list[TokenLogprob] | None = None,
    ) -> _ChatChoice:
        chat_logprobs = None if logprobs is None else _ChatLogprobs(logprobs)
        return _ChatChoice(index, _ChatMessage("assistant", text), chat_logprobs, finish_reason)

    def parsed(
        self,
        delta: ParsedDelta,
        finish_reason: str | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> bytes:
        """The frame of what an output parser made of a text delta (no frame if nothing)."""
        if not delta and finish_reason is None and not logprobs:
            return b""
        chat_delta = _ChatDelta(
            content=delta.content or None,
            reasoning_content=delta.reasoning_content or None,
            tool_calls=delta.tool_calls or None,
        )
        chat_logprobs = _ChatLogprobs(logprobs) if logprobs else None
        return self._chunk(_ChatChunkChoice(self.index, chat_delta, chat_logprobs, finish_reason))

    def parsed_choice(
        self,
        index: int,
        parser: OutputParser,
        finish_reason: str,
        logprobs: list[TokenLogprob] | None = None,
    ) -> _ChatChoice:
        """The choice of a whole answer read by ``parser`` (fed and finished): ``tool_calls``
        as the finish reason of an answer that stopped after calls."""
        calls = parser.tool_calls
        if calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        message = _ChatMessage("assistant", parser.content, parser.reasoning_content, calls or None)
        chat_logprobs = None if logprobs is None else _ChatLogprobs(logprobs)
        return _ChatChoice(index, message, chat_logprobs, finish_reason)

    def body(self, choices: Sequence[_ChatChoice], usage: Usage) -> bytes:
        return _encode(
            _ChatCompletion(
                self.id, "chat.completion", self.created, self.model, list(choices), _usage(usage)
            )
        )


class CompletionRenderer(Renderer[_CompletionChoice]):
    """``text_completion`` frames and body."""

    __slots__ = ("_offset",)

    def __init__(
        self, id: str, model: str, created: int, *, include_usage: bool, index: int = 0
    ) -> None:
        super().__init__(id, model, created, include_usage=include_usage, index=index)
        self._offset = 0  # where the next token's text starts in the choice's text

    def start(self) -> bytes | None:
        return None

    def delta(
        self,
        text: str,
        finish_reason: str | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> bytes:
        if finish_reason is None and logprobs is None:
            return self._head + _encode(text) + self._tail  # the usual delta (see __init__)
        # As in chat, a chunk without new tokens says null.
        return self._frame_of(text, finish_reason, self._legacy(logprobs) if logprobs else None)

    def _frame_of(
        self,
        text: str,
        finish_reason: str | None = None,
        logprobs: _CompletionLogprobs | None = None,
    ) -> bytes:
        choice = _CompletionChoice(self.index, text, logprobs, finish_reason)
        chunk = _CompletionChunk(
            self.id, "text_completion", self.created, self.model, [choice], self._chunk_usage()
        )
        return _frame(_encode(chunk))

    def usage(self, usage: Usage) -> bytes:
        chunk = _CompletionChunk(
            self.id, "text_completion", self.created, self.model, [], _usage(usage)
        )
        return _frame(_encode(chunk))

    def choice(
        self,
        index: int,
        text: str,
        finish_reason: str,
        logprobs: list[TokenLogprob] | None = None,
    ) -> _CompletionChoice:
        return _CompletionChoice(index, text, self._legacy(logprobs), finish_reason)

    def body(self, choices: Sequence[_CompletionChoice], usage: Usage) -> bytes:
        return _encode(
            _Completion(
                self.id, "text_completion", self.created, self.model, list(choices), _usage(usage)
            )
        )

    def _legacy(self, logprobs: list[TokenLogprob] | None) -> _CompletionLogprobs | None:
        """Chat's logprobs in completions' legacy shape, whose ``top_logprobs`` always hold
        the chosen token (OpenAI: "up to logprobs+1 elements")."""
        if logprobs is None:
            return None
        offsets: list[int] = []
        top: list[dict[str, float] | None] = []
        offset = self._offset
        for entry in logprobs:
            offsets.append(offset)
            # Characters of the text, counted by the bytes that start one: a token ending
            # mid-character (its text an escape) moves the offset by the characters it starts.
            offset += sum(1 for byte in entry.bytes if byte & 0xC0 != 0x80)
            if entry.logprob is None:
                top.append(None)  # an echoed prompt's first token: OpenAI's null
                continue
            alternatives = {alt.token: alt.logprob for alt in entry.top_logprobs}
            alternatives.setdefault(entry.token, entry.logprob)
            top.append(alternatives)
        self._offset = offset
        return _CompletionLogprobs(
            [entry.token for entry in logprobs], [entry.logprob for entry in logprobs], top, offsets
        )


def error_frame(error_body: bytes) -> bytes:
    """An SSE ``error`` event carrying an OpenAI error object (compact JSON: one line)."""
    return b"event: error\n" + _frame(error_body)
