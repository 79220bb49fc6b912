"""Llama 3.1+ JSON tool calls (``llama3``, vLLM's ``llama3_json``; SGLang's ``llama3``).

The whole answer is the call, possibly after ``<|python_tag|>``; several calls are separated by
``;``::

    {"name": "get_weather", "parameters": {"city": "Paris"}}

An answer that does not start with a call object is plain content (as in vLLM); ``arguments`` is
accepted for ``parameters``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from protocols.engine import Grammar

from ._base import ToolFormat, ToolParser, dump, tools_json
from ._ebnf import EbnfBuilder
from ._types import ToolSpec

__all__ = ["Llama3Format", "Llama3Parser"]

PYTHON_TAG = "<|python_tag|>"
_START, _CALL, _BETWEEN, _CONTENT = range(4)


class Llama3Parser(ToolParser):
    """JSON call objects at the start of the answer, separated by ``;``."""

    ARGS_KEYS = ("parameters", "arguments")

    def __init__(self, *, names: Collection[str] | None = None, max_calls: int | None = None):
        super().__init__(names=names, max_calls=max_calls)
        self._state = _START
        self._prefix = ""  # what was read before the first call (the tag)

    def _step(self, *, final: bool) -> None:
        while not self._discard:
            state = self._state
            if state == _CONTENT:
                self._content_rest((), final=final)
                return
            if state == _CALL:
                outcome = self._scan_call()
                if outcome == "more":
                    return
                self._state = _BETWEEN if outcome == "done" else _CONTENT
                continue
            rest = self._buf.lstrip()
            if not rest:
                if final:
                    self._state = _CONTENT
                    continue
                return
            if state == _START and rest.startswith(PYTHON_TAG):
                self._prefix += self._buf[: len(self._buf) - len(rest)] + PYTHON_TAG
                self._buf = rest[len(PYTHON_TAG) :]
            elif state == _START and PYTHON_TAG.startswith(rest) and not final:
                return
            elif rest[0] == "{":
                prefix = self._prefix + self._buf[: len(self._buf) - len(rest)]
                self._prefix = ""
                self._buf = rest
                self._open_call(prefix)
                self._state = _CALL
            elif state == _BETWEEN and rest[0] == ";":
                self._buf = rest[1:]
            else:
                self._buf = (self._prefix if state == _START else "") + self._buf
                self._prefix = ""
                self._state = _CONTENT


class Llama3Format(ToolFormat):
    names = ("llama3", "llama3_json")
    parser_type = Llama3Parser

    def system_prompt(self, tools: Sequence[ToolSpec]) -> str:
        # Llama 3.1's own words for JSON tool calling.
        return (
            "Given the following functions, please respond with a JSON for a function call with "
            "its proper arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of argument '
            "name and its value}. Do not use variables.\n\n" + tools_json(tools)
        )

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return "; ".join(dump({"name": name, "parameters": args}) for name, args in calls)

    def render_result(self, content: str, name: str | None) -> str:
        return content

    def grammar(self, tools: Sequence[ToolSpec], *, parallel: bool) -> Grammar:
        b = EbnfBuilder()
        call = b.call(tools, "parameters")
        root = f'{call} ("; " {call})*' if parallel else call
        return Grammar(kind="ebnf", spec=b.grammar(root))
