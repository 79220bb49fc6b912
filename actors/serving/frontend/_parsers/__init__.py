"""Output parsers: tool calls and reasoning read out of a choice's text, incrementally.

:func:`output_parser` gives a choice its :class:`OutputParser` (or ``None``: plain text, the fast
path); :func:`tool_format` gives the selected tool-call format's prompt rendering and the grammar
that forces calls. Parsers by name (``--tool-call-parser``, ``--reasoning-parser``):
:data:`TOOL_CALL_PARSER_NAMES`, :data:`REASONING_PARSER_NAMES`.
"""

from ._base import ToolFormat, ToolParser
from ._output import (
    REASONING_PARSER_NAMES,
    TOOL_CALL_PARSER_NAMES,
    OutputParser,
    check_parser_names,
    output_parser,
    tool_format,
)
from ._reasoning import ReasoningParser
from ._types import FunctionCall, FunctionDelta, ParsedDelta, ToolCall, ToolCallDelta, ToolSpec

__all__ = [
    "REASONING_PARSER_NAMES",
    "TOOL_CALL_PARSER_NAMES",
    "FunctionCall",
    "FunctionDelta",
    "OutputParser",
    "ParsedDelta",
    "ReasoningParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolFormat",
    "ToolParser",
    "ToolSpec",
    "check_parser_names",
    "output_parser",
    "tool_format",
]
