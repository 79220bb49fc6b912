"""The reasoning parsers on recorded outputs (DeepSeek-R1, Qwen3), split at every position."""

from __future__ import annotations

import pytest

from actors.serving.frontend._parsers import REASONING_PARSER_NAMES, output_parser

from ._parsing import feed, splits

# (parser, model output, reasoning, content)
CASES: list[tuple[str, str, str | None, str]] = [
    (
        "deepseek-r1",
        "Okay, the user asks for 2 + 2. That is 4.\n</think>\n\nThe answer is **4**.",
        "Okay, the user asks for 2 + 2. That is 4.\n",
        "The answer is **4**.",
    ),
    (
        "deepseek-r1",
        "<think>\nFirst, < is less-than; </thin is no tag.\n</think>\n\nDone.",
        "First, < is less-than; </thin is no tag.\n",
        "Done.",
    ),
    # Cut short while reasoning: all of it is reasoning.
    ("deepseek-r1", "Let me think about this carefully", "Let me think about this carefully", ""),
    (
        "qwen3",
        "<think>\nThe user greets me. I should greet back.\n</think>\n\nHello! How can I help?",
        "The user greets me. I should greet back.\n",
        "Hello! How can I help?",
    ),
    ("qwen3", "<think>\n\n</think>\n\nHi there.", None, "Hi there."),  # thinking turned off
    (
        "qwen3",
        "Hello! No thinking here. <think> is a tag.",
        None,
        "Hello! No thinking here. <think> is a tag.",
    ),
    ("qwen3", "<thinking>aloud</thinking>", None, "<thinking>aloud</thinking>"),
    ("qwen3-thinking", "Hmm.</think>Yes.", "Hmm.", "Yes."),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_every_split_gives_the_same_parts(
    name: str, text: str, reasoning: str | None, content: str
) -> None:
    for pieces in splits(text):
        p = output_parser(reasoning_parser=name)
        assert p is not None
        got = feed(p, pieces)
        assert (got.result_reasoning, got.result_content) == (reasoning, content), pieces
        assert (got.reasoning, got.content) == (reasoning or "", content), pieces
        assert not got.made


def test_reasoning_then_tool_calls() -> None:
    text = (
        "<think>\nThe user wants the weather; I call the tool.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    for pieces in splits(text):
        p = output_parser(tool_parser="hermes", reasoning_parser="qwen3")
        assert p is not None
        got = feed(p, pieces)
        assert got.result_reasoning == "The user wants the weather; I call the tool.\n"
        assert got.result_content is None
        assert got.result_calls == [("get_weather", {"city": "Paris"})]
        assert got.made and got.content == ""


def test_names() -> None:
    assert {"deepseek-r1", "qwen3"} <= set(REASONING_PARSER_NAMES)
