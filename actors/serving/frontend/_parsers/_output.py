"""One choice's output parser: reasoning first, then tool calls in what is left (the content)."""

from __future__ import annotations

from collections.abc import Collection

from ._base import ToolFormat, ToolParser
from ._hermes import HermesFormat
from ._llama3 import Llama3Format
from ._mistral import MistralFormat
from ._reasoning import REASONING_PARSERS, ReasoningParser
from ._types import ParsedDelta, ToolCall, ToolCallDelta

__all__ = [
    "REASONING_PARSER_NAMES",
    "TOOL_CALL_PARSER_NAMES",
    "OutputParser",
    "check_parser_names",
    "output_parser",
    "tool_format",
]

_FORMATS: dict[str, ToolFormat] = {
    name: fmt for fmt in (HermesFormat(), Llama3Format(), MistralFormat()) for name in fmt.names
}

TOOL_CALL_PARSER_NAMES: tuple[str, ...] = tuple(sorted(_FORMATS))
REASONING_PARSER_NAMES: tuple[str, ...] = tuple(sorted(REASONING_PARSERS))


def tool_format(name: str) -> ToolFormat:
    """The tool-call format ``--tool-call-parser name`` selects (``ValueError`` if unknown)."""
    try:
        return _FORMATS[name]
    except KeyError:
        known = ", ".join(TOOL_CALL_PARSER_NAMES)
        raise ValueError(f"unknown tool-call parser {name!r} (known: {known})") from None


def check_parser_names(tool_call_parser: str | None, reasoning_parser: str | None) -> None:
    """Refuse unknown parser names at start, listing the known ones."""
    if tool_call_parser is not None:
        tool_format(tool_call_parser)
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        known = ", ".join(REASONING_PARSER_NAMES)
        raise ValueError(f"unknown reasoning parser {reasoning_parser!r} (known: {known})")


class OutputParser:
    """Parses one choice's text as it streams: :meth:`feed` each new text, :meth:`finish` at the
    end; each returns a :class:`ParsedDelta`. After :meth:`finish`, :attr:`content`,
    :attr:`reasoning_content` and :attr:`tool_calls` hold the whole non-streaming message."""

    __slots__ = ("_content", "_reasoning", "_reasoning_parts", "_tools")

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._reasoning_parts: list[str] = []
        self._content: list[str] = []

    @property
    def tool_calls_made(self) -> bool:
        """Whether a call was streamed: the stream finishes with ``tool_calls`` (when it stopped);
        a whole answer does when :attr:`tool_calls` is not empty."""
        return self._tools is not None and self._tools.tool_calls_made

    def feed(self, text: str) -> ParsedDelta:
        return self._parse(text, final=False)

    def finish(self) -> ParsedDelta:
        return self._parse("", final=True)

    def _parse(self, text: str, *, final: bool) -> ParsedDelta:
        reasoning, content = "", text
        if self._reasoning is not None:
            if final:
                reasoning, content = self._reasoning.finish()
            else:
                reasoning, content = self._reasoning.feed(text)
            if reasoning:
                self._reasoning_parts.append(reasoning)
        if self._tools is None:
            self._content.append(content)
            return ParsedDelta(content, reasoning)
        deltas: list[ToolCallDelta] = []
        if content:
            content, deltas = self._tools.feed(content)
        if final:
            tail, more = self._tools.finish()
            content += tail
            deltas += more
        return ParsedDelta(content, reasoning, deltas)

    @property
    def content(self) -> str | None:
        """The answer's text (``None`` when it is empty and calls were made, as OpenAI says)."""
        parts = self._content if self._tools is None else self._tools.result_content
        text = "".join(parts)
        return None if not text and self.tool_calls else text

    @property
    def reasoning_content(self) -> str | None:
        return "".join(self._reasoning_parts) if self._reasoning_parts else None

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [] if self._tools is None else list(self._tools.calls)


def output_parser(
    *,
    tool_parser: str | None = None,
    reasoning_parser: str | None = None,
    tool_names: Collection[str] | None = None,
    max_calls: int | None = None,
    separate_reasoning: bool = True,
) -> OutputParser | None:
    """A parser for one choice, or ``None`` when there is nothing to parse (the plain path).

    ``tool_parser``: the format to read calls in, only when the request has tools (and
    ``tool_choice`` is not ``none``); ``tool_names`` restricts calls to those functions;
    ``max_calls=1`` for ``parallel_tool_calls: false``. ``separate_reasoning=False`` turns the
    reasoning parser off for a request (SGLang's extension).
    """
    reasoning = None
    if reasoning_parser is not None and separate_reasoning:
        check_parser_names(None, reasoning_parser)
        reasoning = ReasoningParser(force=REASONING_PARSERS[reasoning_parser])
    tools = None
    if tool_parser is not None:
        tools = tool_format(tool_parser).parser(names=tool_names, max_calls=max_calls)
    if reasoning is None and tools is None:
        return None
    return OutputParser(reasoning, tools)
