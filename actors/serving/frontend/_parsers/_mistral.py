"""Mistral tool calls (``mistral``): a JSON array of calls after ``[TOOL_CALLS]``::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

``[TOOL_CALLS]`` is a special token in Mistral's tokenizers, which detokenisation skips, so an
answer that starts with the array itself (``[{``) is read as calls too; after text, only the
marker starts calls. (The v11 form ``[TOOL_CALLS]name[ARGS]{...}`` is not read.)
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from protocols.engine import Grammar

from ._base import ToolFormat, ToolParser, dump
from ._ebnf import EbnfBuilder
from ._types import ToolSpec

__all__ = ["MistralFormat", "MistralParser"]

MARKER = "[TOOL_CALLS]"
_START, _CONTENT, _OPEN, _ITEM, _CALL, _SEP = range(6)


class MistralParser(ToolParser):
    """``[TOOL_CALLS][{...}, {...}]``, or the bare array at the start of the answer."""

    def __init__(self, *, names: Collection[str] | None = None, max_calls: int | None = None):
        super().__init__(names=names, max_calls=max_calls)
        self._state = _START
        self._prefix = ""  # what opened the array (content again if no call follows)

    def _step(self, *, final: bool) -> None:
        while not self._discard:
            state = self._state
            if state == _CALL:
                outcome = self._scan_call()
                if outcome == "more":
                    return
                self._state = _SEP if outcome == "done" else _CONTENT
                continue
            if state == _CONTENT:
                at = self._buf.find(MARKER)
                if at == -1:
                    self._content_rest((MARKER,), final=final)
                    return
                self._prefix = self._content_before(at) + MARKER
                self._buf = self._buf[len(MARKER) :]
                self._state = _OPEN
                continue
            rest = self._buf.lstrip()
            skipped = self._buf[: len(self._buf) - len(rest)]
            if not rest and not final:
                return
            if state == _START:
                if rest and not rest.startswith(MARKER) and MARKER.startswith(rest) and not final:
                    return  # may be the marker
                if rest.startswith("[") and not rest.startswith(MARKER):
                    after = rest[1:].lstrip()
                    if not after and not final:
                        return
                    if after.startswith("{"):
                        self._prefix = skipped + "["
                        self._buf = rest[1:]
                        self._state = _ITEM
                        continue
                self._state = _CONTENT
            elif state == _OPEN:
                if rest.startswith("["):
                    self._prefix += skipped + "["
                    self._buf = rest[1:]
                    self._state = _ITEM
                else:
                    self._buf = self._prefix + self._buf
                    self._prefix = ""
                    self._state = _CONTENT
                    if not final:
                        # The marker is content now: emit it rather than find it again.
                        self._content_rest((), final=True)
                        self._state = _CONTENT
            elif state == _ITEM:
                if rest.startswith("{"):
                    self._open_call(self._prefix + skipped)
                    self._prefix = ""
                    self._buf = rest
                    self._state = _CALL
                else:
                    self._buf = self._prefix + self._buf
                    self._prefix = ""
                    self._content_rest((), final=True)
                    self._state = _CONTENT
            elif state == _SEP:
                if rest.startswith(","):
                    self._prefix = skipped + ","
                    self._buf = rest[1:]
                    self._state = _ITEM
                elif rest.startswith("]"):
                    self._buf = rest[1:]
                    self._state = _CONTENT
                else:
                    self._state = _CONTENT
                    if not rest:
                        return


class MistralFormat(ToolFormat):
    names = ("mistral",)
    parser_type = MistralParser

    def system_prompt(self, tools: Sequence[ToolSpec]) -> str:
        # Mistral's own tools block, then the call format in words (its template has none).
        return (
            f"[AVAILABLE_TOOLS][{', '.join(dump(t.openai()) for t in tools)}][/AVAILABLE_TOOLS]\n"
            "To call functions, answer with [TOOL_CALLS] and a JSON list of calls: "
            '[TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>}]'
        )

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        items = ", ".join(dump({"name": name, "arguments": args}) for name, args in calls)
        return f"{MARKER}[{items}]"

    def render_result(self, content: str, name: str | None) -> str:
        return f"[TOOL_RESULTS]{content}[/TOOL_RESULTS]"

    def grammar(self, tools: Sequence[ToolSpec], *, parallel: bool) -> Grammar:
        # The bare array: the marker is a special token a grammar's text cannot produce.
        b = EbnfBuilder()
        call = b.call(tools)
        root = f'"[" {call} ("," sp {call})* "]"' if parallel else f'"[" {call} "]"'
        return Grammar(kind="ebnf", spec=b.grammar(root))
