"""Hermes tool calls, as Hermes-2/3, Qwen2.5 and Qwen3 write them (``hermes``; SGLang's
``qwen25`` and ``qwen``).

Each call is a JSON object inside tags, after any text, one block per call::

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Tool results go back in ``<tool_response>`` tags (in a ``tool`` message, or a user message where
the template has no ``tool`` role).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from protocols.engine import Grammar

from ._base import ToolFormat, ToolParser, dump, tools_json
from ._ebnf import EbnfBuilder, literal
from ._types import ToolSpec

__all__ = ["HermesFormat", "HermesParser"]

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesParser(ToolParser):
    """``<tool_call>{...}</tool_call>`` blocks anywhere in the text."""

    def __init__(self, *, names: Collection[str] | None = None, max_calls: int | None = None):
        super().__init__(names=names, max_calls=max_calls)
        self._closing = False  # a call object ended: its closing tag comes next

    def _step(self, *, final: bool) -> None:
        while not self._discard:
            if self._scanner is not None:
                outcome = self._scan_call()
                if outcome == "more":
                    return
                self._closing = outcome == "done"
            elif self._closing:
                rest = self._buf.lstrip()
                if rest.startswith(CLOSE):
                    self._buf = rest[len(CLOSE) :]
                elif (not rest or CLOSE.startswith(rest)) and not final:
                    return  # the tag may still come
                self._closing = False  # (without its closing tag, the call still stands)
            else:
                at = self._buf.find(OPEN)
                if at == -1:
                    self._content_rest((OPEN,), final=final)
                    return
                ws = self._content_before(at)
                self._buf = self._buf[len(OPEN) :]
                self._open_call(ws + OPEN)


class HermesFormat(ToolFormat):
    names = ("hermes", "qwen25", "qwen")
    parser_type = HermesParser

    def system_prompt(self, tools: Sequence[ToolSpec]) -> str:
        # Qwen2.5's own words for its tools section.
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{tools_json(tools)}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>"
        )

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return "\n".join(
            f"{OPEN}\n{dump({'name': name, 'arguments': args})}\n{CLOSE}" for name, args in calls
        )

    def grammar(self, tools: Sequence[ToolSpec], *, parallel: bool) -> Grammar:
        b = EbnfBuilder()
        call = b.rule(f"{literal(OPEN + chr(10))} {b.call(tools)} {literal(chr(10) + CLOSE)}")
        root = f'{call} ("\\n" {call})*' if parallel else call
        return Grammar(kind="ebnf", spec=b.grammar(root))
