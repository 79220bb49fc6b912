"""What the output parsers produce: OpenAI's tool-call shapes (msgspec structs, so the renderers
encode them as they are) and one parsed delta."""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

import msgspec

__all__ = [
    "FunctionCall",
    "FunctionDelta",
    "ParsedDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolSpec",
    "new_call_id",
]


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    """``function`` of a streamed tool-call delta: the name on the first, arguments after."""

    name: str | msgspec.UnsetType = msgspec.UNSET
    arguments: str = ""


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """One entry of a chunk's ``delta.tool_calls``: the first delta of a call carries ``id``,
    ``type`` and the function's name; later ones only argument fragments."""

    index: int
    function: FunctionDelta
    id: str | msgspec.UnsetType = msgspec.UNSET
    type: str | msgspec.UnsetType = msgspec.UNSET


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct):
    """One complete call, as in a non-streaming ``message.tool_calls``."""

    id: str
    function: FunctionCall
    type: str = "function"


@dataclasses.dataclass(slots=True)
class ParsedDelta:
    """What one piece of model output became: answer text, reasoning text, tool-call deltas."""

    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning_content or self.tool_calls)


@dataclasses.dataclass(frozen=True, slots=True)
class ToolSpec:
    """A function the model may call (a request's ``tools`` entry)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def openai(self) -> dict[str, Any]:
        """The tool in OpenAI's (and Hugging Face chat templates') JSON form."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = (
            self.parameters if self.parameters is not None else {"type": "object", "properties": {}}
        )
        return {"type": "function", "function": function}


def new_call_id() -> str:
    """A fresh tool-call id, OpenAI-style (``call_`` and 24 random characters)."""
    return "call_" + secrets.token_hex(12)
