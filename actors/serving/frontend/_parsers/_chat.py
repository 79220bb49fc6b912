"""A chat request's tools: what the request asks for (:func:`tool_plan`) and the conversation
as the chat template gets it (:func:`template_messages`).

Where the model's template renders tools itself (it mentions ``tools``), it gets them in Hugging
Face's form: ``tools=`` in OpenAI's JSON form, an assistant's ``tool_calls`` with arguments as
objects, ``tool`` messages with their ``tool_call_id``. Where it does not (SmolLM2's, the mock's
plain-text one), the frontend writes them into the messages in the selected parser's format, so
the model still sees them and answers in the format that is parsed: the tool definitions and the
call format in a system message (appended to the conversation's own first system message), an
assistant's calls in its content as the model writes them, tool results as a user message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from protocols.engine import Grammar

from .._errors import invalid
from .._openai_types import ChatCompletionRequest, ChatMessage, NamedToolChoice
from ._base import ToolFormat, arguments_object
from ._hermes import HermesFormat
from ._output import TOOL_CALL_PARSER_NAMES, tool_format
from ._types import ToolSpec

__all__ = ["ToolPlan", "template_messages", "tool_plan"]


@dataclasses.dataclass(frozen=True, slots=True)
class ToolPlan:
    """How a chat request's tools are served.

    ``tools``: those offered (shown to the model); ``parser``: the format calls are read in, or
    ``None`` (no tools, or ``tool_choice: none``); ``names``: the functions a call may name;
    ``max_calls``: 1 for ``parallel_tool_calls: false``; ``grammar``: the constrained decoding
    that forces calls (``required``, a named function).
    """

    tools: tuple[ToolSpec, ...] = ()
    parser: str | None = None
    names: frozenset[str] | None = None
    max_calls: int | None = None
    grammar: Grammar | None = None


NO_TOOLS = ToolPlan()


def tool_plan(body: ChatCompletionRequest, tool_call_parser: str | None) -> ToolPlan:
    """The request's :class:`ToolPlan`; a 400 naming the field for what cannot be served."""
    if not body.tools:
        return NO_TOOLS
    tools = tuple(
        ToolSpec(t.function.name, t.function.description, t.function.parameters, t.function.strict)
        for t in body.tools
    )
    choice = body.tool_choice or "auto"
    if choice == "none":
        return ToolPlan(tools)
    if tool_call_parser is None:
        raise invalid(
            "tools need a tool-call parser, and this server has none: start it with "
            f"--tool-call-parser ({', '.join(TOOL_CALL_PARSER_NAMES)}), or send "
            'tool_choice "none"',
            "tools",
        )
    fmt = tool_format(tool_call_parser)
    names = frozenset(t.name for t in tools)
    max_calls = None if body.parallel_tool_calls else 1
    if choice == "auto":
        return ToolPlan(tools, tool_call_parser, names, max_calls)
    if _constrained(body):
        raise invalid(
            "tool_choice required or a named function is enforced by constrained decoding, "
            "which cannot be combined with response_format, regex or ebnf",
            "tool_choice",
        )
    if isinstance(choice, NamedToolChoice):
        forced = tuple(t for t in tools if t.name == choice.function.name)
        grammar = fmt.grammar(forced, parallel=False)
        return ToolPlan(tools, tool_call_parser, frozenset({forced[0].name}), 1, grammar)
    return ToolPlan(
        tools, tool_call_parser, names, max_calls, fmt.grammar(tools, parallel=max_calls is None)
    )


def _constrained(body: ChatCompletionRequest) -> bool:
    fmt = body.response_format
    json_format = fmt is not None and fmt.type != "text"
    return json_format or body.regex is not None or body.ebnf is not None


def template_messages(
    messages: Sequence[ChatMessage], plan: ToolPlan, *, native: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The conversation for the chat template, and the ``tools`` argument it takes (``native``:
    the template renders tools; else they are written into the messages, see the module)."""
    if native:
        return _native(messages), [t.openai() for t in plan.tools] or None
    fmt = tool_format(plan.parser) if plan.parser is not None else _HISTORY_FORMAT
    out: list[dict[str, Any]] = []
    for msg in messages:
        text = msg.text()
        if msg.tool_calls:
            calls = fmt.render_calls(
                [(c.function.name, arguments_object(c.function.arguments)) for c in msg.tool_calls]
            )
            out.append(_entry(msg, f"{text}\n{calls}" if text else calls))
        elif msg.role == "tool":
            result = fmt.render_result(text, msg.name)
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + result  # consecutive results: one message
            else:
                out.append({"role": "user", "content": result, "tool_results": True})
        else:
            out.append(_entry(msg, text))
    for entry in out:
        entry.pop("tool_results", None)
    if plan.parser is not None and plan.tools:
        _add_system(out, fmt.system_prompt(plan.tools))
    return out, None


#: How an assistant's earlier calls are written when the server reads none (no parser).
_HISTORY_FORMAT: ToolFormat = HermesFormat()


def _entry(msg: ChatMessage, text: str) -> dict[str, Any]:
    entry: dict[str, Any] = {"role": msg.role, "content": text}
    if msg.name:
        entry["name"] = msg.name
    return entry


def _add_system(out: list[dict[str, Any]], prompt: str) -> None:
    if out and out[0]["role"] in ("system", "developer"):
        first = out[0]["content"]
        out[0]["content"] = f"{first}\n\n{prompt}" if first else prompt
    else:
        out.insert(0, {"role": "system", "content": prompt})


def _native(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    names: dict[str, str] = {}  # call id -> function name, for templates that show it
    out: list[dict[str, Any]] = []
    for msg in messages:
        entry = _entry(msg, msg.text())
        if msg.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": arguments_object(c.function.arguments),
                    },
                }
                for c in msg.tool_calls
            ]
            names.update((c.id, c.function.name) for c in msg.tool_calls)
        if msg.role == "tool" and msg.tool_call_id is not None:
            entry["tool_call_id"] = msg.tool_call_id
            if msg.tool_call_id in names and "name" not in entry:
                entry["name"] = names[msg.tool_call_id]
        out.append(entry)
    return out
