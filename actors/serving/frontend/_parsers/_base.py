"""What every tool-call parser shares: the call bookkeeping, the streamed deltas, the fallback of
malformed calls to content, and the :class:`ToolFormat` a parser is chosen by."""

from __future__ import annotations

import abc
import json
from collections.abc import Collection, Sequence
from typing import Any

from protocols.engine import Grammar

from ._scan import CallScanner, held_prefix
from ._types import FunctionCall, FunctionDelta, ToolCall, ToolCallDelta, ToolSpec, new_call_id

__all__ = ["ToolFormat", "ToolParser", "arguments_object", "dump", "tools_json"]


class ToolParser(abc.ABC):
    """Splits one choice's text into content and tool calls, incrementally.

    ``feed`` takes the next text (split anywhere) and returns the content safe to send and the
    tool-call deltas now known; ``finish`` flushes the rest. Subclasses read their format in
    :meth:`_step`, with :meth:`_content_before` and :meth:`_content_rest` for plain text and
    :meth:`_scan_call` for a call object.

    Text that turns out not to be a call (not JSON, an unknown function, a stray key) is content,
    never lost. A call found malformed only after its arguments began to stream (invalid JSON
    further on, or the output cut short) has been partly sent: its streamed deltas stand, the rest
    is content; in the non-streaming result (:attr:`calls`, :attr:`result_content`) the whole call
    is content instead. ``max_calls`` (1 for ``parallel_tool_calls: false``) drops the rest of the
    output once that many calls are complete.
    """

    #: The keys a call object may hold its arguments under.
    ARGS_KEYS: Collection[str] = ("arguments",)

    def __init__(self, *, names: Collection[str] | None = None, max_calls: int | None = None):
        self._names = names
        self._max_calls = max_calls
        self._buf = ""  # text not consumed yet
        self._out: list[str] = []  # content of the current feed
        self._deltas: list[ToolCallDelta] = []
        self._scanner: CallScanner | None = None
        self._call_prefix = ""  # the text that opened the current call (its tag)
        self._call_id = ""
        self._started = 0  # calls whose first delta went out (the next call's index)
        self._trailing_ws = ""  # whitespace held back: dropped if a call follows
        self._discard = False
        self._after_call = False  # content right after a call starts at its first non-space
        self.calls: list[ToolCall] = []
        self.result_content: list[str] = []

    @property
    def tool_calls_made(self) -> bool:
        """Whether a call was streamed (a stream then finishes with ``tool_calls``; a whole answer
        does when :attr:`calls` is not empty)."""
        return self._started > 0

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if self._discard:
            return "", []
        self._buf += text
        self._step(final=False)
        return self._take()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if not self._discard:
            self._step(final=True)
            if self._scanner is not None:
                self._call_failed()  # cut short inside a call
                self._step(final=True)
            if self._trailing_ws and not self.calls:
                self._emit(self._trailing_ws)
            self._trailing_ws = ""
        return self._take()

    def _take(self) -> tuple[str, list[ToolCallDelta]]:
        text = "".join(self._out)
        self._out.clear()
        deltas, self._deltas = self._deltas, []
        return text, deltas

    @abc.abstractmethod
    def _step(self, *, final: bool) -> None:
        """Consume as much of ``self._buf`` as can be decided now (all of it when ``final``)."""

    # --- helpers for the formats ----------------------------------------------------------------

    def _emit(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        if text:
            self._out.append(text)
            self.result_content.append(text)

    def _content_before(self, end: int) -> str:
        """Send ``self._buf[:end]`` as content: a call may start at ``end``, so the whitespace
        before it is kept out (returned: the call's prefix, content again if it is no call)."""
        text = self._buf[:end]
        body = text.rstrip()
        if body:
            self._emit(self._trailing_ws + body)
            self._trailing_ws = ""
        ws = self._trailing_ws + text[len(body) :]
        self._trailing_ws = ""
        self._buf = self._buf[end:]
        return ws

    def _content_rest(self, markers: Sequence[str], *, final: bool) -> None:
        """Send ``self._buf`` as content, less the end that may start one of ``markers`` (kept
        in the buffer) and its trailing whitespace (held: dropped if a call follows)."""
        text = self._buf
        held = 0 if final else held_prefix(text, markers)
        safe = text[: len(text) - held]
        body = safe.rstrip()
        if body:
            self._emit(self._trailing_ws + body)
            self._trailing_ws = safe[len(body) :]
        else:
            self._trailing_ws += safe
        self._buf = text[len(safe) :]

    def _open_call(self, prefix: str) -> None:
        """A call begins after ``prefix`` (the text that opened it, content if it is no call)."""
        self._scanner = CallScanner(self.ARGS_KEYS, self._names)
        self._call_prefix = prefix
        self._call_id = new_call_id()

    def _scan_call(self) -> str:
        """Feed the current call; ``"more"`` (needs text), ``"done"`` or ``"failed"``."""
        scanner = self._scanner
        assert scanner is not None
        used = scanner.feed(self._buf)
        self._buf = self._buf[used:]
        name, args = scanner.take()
        if name is not None:
            self._deltas.append(
                ToolCallDelta(self._started, FunctionDelta(name, args), self._call_id, "function")
            )
            self._started += 1
        elif args:
            self._deltas.append(ToolCallDelta(self._started - 1, FunctionDelta(arguments=args)))
        if scanner.done:
            assert scanner.name is not None and scanner.arguments is not None
            arguments = "".join(scanner.arguments)
            self.calls.append(ToolCall(self._call_id, FunctionCall(scanner.name, arguments)))
            self._scanner = None
            self._after_call = True
            self._trailing_ws = ""
            if self._max_calls is not None and len(self.calls) >= self._max_calls:
                self._discard = True
                self._buf = ""
            return "done"
        if scanner.failed:
            self._call_failed()
            return "failed"
        return "more"

    def _call_failed(self) -> None:
        """The current call is not one: its text so far is content (see the class)."""
        scanner = self._scanner
        assert scanner is not None
        self._scanner = None
        text = self._call_prefix + "".join(scanner.raw)
        if scanner.announced:
            self.result_content.append(text)  # the stream already has its deltas
        else:
            self._out.append(text)
            self.result_content.append(text)


class ToolFormat(abc.ABC):
    """A tool-call format by its parser's name: how calls are parsed from the output, how tools
    and calls are written into a prompt whose chat template cannot, and the grammar that forces
    calls (``tool_choice`` ``required`` or a named function)."""

    #: The names ``--tool-call-parser`` knows it by (SGLang's and vLLM's).
    names: tuple[str, ...] = ()
    #: The format's parser.
    parser_type: type[ToolParser]

    def parser(
        self, *, names: Collection[str] | None = None, max_calls: int | None = None
    ) -> ToolParser:
        """A fresh parser for one choice."""
        return self.parser_type(names=names, max_calls=max_calls)

    @abc.abstractmethod
    def system_prompt(self, tools: Sequence[ToolSpec]) -> str:
        """The tools and how to call them, for a system message (templates without tools)."""

    @abc.abstractmethod
    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        """An assistant's calls (name, arguments object) as the model writes them."""

    def render_result(self, content: str, name: str | None) -> str:
        """A tool's result, as a user message's text (templates without a ``tool`` role)."""
        return f"<tool_response>\n{content}\n</tool_response>"

    @abc.abstractmethod
    def grammar(self, tools: Sequence[ToolSpec], *, parallel: bool) -> Grammar:
        """Constrained decoding that makes the output one call (``parallel``: one or more) of
        one of ``tools``, in this format."""


def arguments_object(arguments: str) -> Any:
    """A call's ``arguments`` text as a JSON value for a template (the text if it is not JSON)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def dump(value: Any) -> str:
    """JSON as models are shown it (``", "`` and ``": "`` separators, Unicode as is)."""
    return json.dumps(value, ensure_ascii=False)


def tools_json(tools: Sequence[ToolSpec]) -> str:
    """The tools in OpenAI's JSON form, one a line."""
    return "\n".join(dump(tool.openai()) for tool in tools)
