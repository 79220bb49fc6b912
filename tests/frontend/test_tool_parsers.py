"""Tool-call parsers on recorded model outputs of each format, split at every position."""

from __future__ import annotations

import json
from typing import Any

import pytest

from actors.serving.frontend._parsers import (
    TOOL_CALL_PARSER_NAMES,
    OutputParser,
    check_parser_names,
    output_parser,
)

from ._parsing import feed, splits

WEATHER = "get_current_weather"
NAMES = frozenset({WEATHER, "run_code", "search"})


def parser(name: str, **kw: Any) -> OutputParser:
    p = output_parser(tool_parser=name, tool_names=kw.pop("names", NAMES), **kw)
    assert p is not None
    return p


# (parser, model output, content, calls): what every split of the output must give, streamed
# and not. Outputs as Qwen2.5 (hermes), Llama 3.1 (llama3) and Mistral (mistral) write them.
CASES: list[tuple[str, str, str | None, list[tuple[str, Any]]]] = [
    (
        "hermes",
        '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "San Francisco, '
        'CA", "unit": "celsius"}}\n</tool_call>',
        None,
        [(WEATHER, {"location": "San Francisco, CA", "unit": "celsius"})],
    ),
    (
        "qwen25",
        "I'll check both cities for you.\n<tool_call>\n"
        '{"name": "get_current_weather", "arguments": {"location": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "東京", '
        '"days": [1, 2]}}\n</tool_call>',
        "I'll check both cities for you.",
        [(WEATHER, {"location": "Paris"}), (WEATHER, {"location": "東京", "days": [1, 2]})],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "run_code", "arguments": {"code": "print(\\"}{\\")\\nx = '
        '{\'a\': [1, 2]}", "timeout": 3.5, "env": {"A": null, "B": [true, false]}}}\n'
        "</tool_call>\nI ran it.",
        "I ran it.",
        [
            (
                "run_code",
                {
                    "code": "print(\"}{\")\nx = {'a': [1, 2]}",
                    "timeout": 3.5,
                    "env": {"A": None, "B": [True, False]},
                },
            )
        ],
    ),
    (
        "hermes",
        '<tool_call>\n{"arguments": {"q": "x"}, "name": "search"}\n</tool_call>',
        None,
        [("search", {"q": "x"})],
    ),
    ("hermes", '<tool_call>{"name": "search"}</tool_call>', None, [("search", {})]),
    (
        "hermes",
        "Use a <b>bold</b> tag, or a <tool> of your choice: 1 < 2 <",
        "Use a <b>bold</b> tag, or a <tool> of your choice: 1 < 2 <",
        [],
    ),
    (
        "hermes",
        "<tool_call>\nI cannot call a tool here.\n</tool_call> Sorry.",
        "<tool_call>\nI cannot call a tool here.\n</tool_call> Sorry.",
        [],
    ),
    (
        "hermes",
        'Calling. <tool_call>\n{"name": "launch_missiles", "arguments": {}}\n</tool_call>',
        'Calling. <tool_call>\n{"name": "launch_missiles", "arguments": {}}\n</tool_call>',
        [],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "search", "arguments": "q=x"}\n</tool_call>',
        '<tool_call>\n{"name": "search", "arguments": "q=x"}\n</tool_call>',
        [],
    ),
    (
        "llama3",
        '{"name": "get_current_weather", "parameters": {"location": "Paris", "unit": "celsius"}}',
        None,
        [(WEATHER, {"location": "Paris", "unit": "celsius"})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "search", "parameters": {"q": "llamas"}}; '
        '{"name": "get_current_weather", "parameters": {"location": "Lima"}}',
        None,
        [("search", {"q": "llamas"}), (WEATHER, {"location": "Lima"})],
    ),
    (
        "llama3",
        '\n\n{"name": "search", "arguments": {"q": "x"}}',
        None,
        [("search", {"q": "x"})],
    ),
    ("llama3", "The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    ("llama3", '{"answer": 42, "name": "x"}', '{"answer": 42, "name": "x"}', []),
    (
        "llama3",
        'It is {"name": "search"} as text.',
        'It is {"name": "search"} as text.',
        [],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_current_weather", "arguments": {"location": "Paris"}}, '
        '{"name": "search", "arguments": {"q": "louvre"}}]',
        None,
        [(WEATHER, {"location": "Paris"}), ("search", {"q": "louvre"})],
    ),
    (
        "mistral",
        '[{"name": "get_current_weather", "arguments": {"location": "Paris"}}]',
        None,
        [(WEATHER, {"location": "Paris"})],
    ),
    (
        "mistral",
        'Let me look. [TOOL_CALLS][{"name": "search", "arguments": {"q": "[x]"}}]',
        "Let me look.",
        [("search", {"q": "[x]"})],
    ),
    ("mistral", "[1, 2, 3] are the numbers.", "[1, 2, 3] are the numbers.", []),
    ("mistral", "[TOOL_CALLS] no list here", "[TOOL_CALLS] no list here", []),
    ("mistral", "See [TOOLS] and [TOOL_CALL", "See [TOOLS] and [TOOL_CALL", []),
]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_every_split_gives_the_same_calls(
    name: str, text: str, content: str | None, calls: list[tuple[str, Any]]
) -> None:
    first = None
    for pieces in splits(text):
        got = feed(parser(name), pieces)
        assert got.result_content == content, pieces
        assert got.result_calls == calls, pieces
        assert got.made == bool(calls)
        # Streamed: the same content and calls, each call's fragments valid JSON together.
        assert got.content == (content or "")
        assert [(c["name"], json.loads(c["arguments"])) for c in got.calls] == calls
        if first is None:
            first = got
        assert got.same_as(first)


def test_arguments_stream_before_the_call_ends() -> None:
    p = parser("hermes")
    opening = p.feed("Sure.\n<tool_call>\n")
    assert opening.content == "Sure." and not opening.tool_calls
    first = p.feed('{"name": "search", "arguments": {"q": "ab')
    [delta] = first.tool_calls
    assert delta.index == 0 and delta.function.name == "search"
    assert delta.function.arguments == '{"q": "ab'
    [more] = p.feed('c"}}').tool_calls
    assert more.function.arguments == 'c"}' and more.id is more.type  # both unset
    assert p.feed("\n</tool_call>") == type(first)()
    assert p.tool_calls_made


def test_malformed_after_the_arguments_began() -> None:
    # The stream already has the call's start: its deltas stand and the rest is content; the
    # non-streaming answer has the whole text as content and no call.
    text = '<tool_call>\n{"name": "search", "arguments": {"q": Paris}}\n</tool_call> ok'
    for pieces in splits(text):
        got = feed(parser("hermes"), pieces)
        assert got.result_content == text
        assert got.result_calls == []
        # Split inside the arguments, a stream sent the call's start (it finishes with
        # tool_calls); in one piece, nothing of it.
        assert [c["name"] for c in got.calls] in ([], ["search"])
        assert got.made == bool(got.calls)
        if len(pieces) == len(text):
            assert got.calls and got.content == "\n</tool_call> ok"


def test_output_cut_inside_a_call() -> None:
    text = 'Hm. <tool_call>\n{"name": "search", "arguments": {"q": "unfini'
    for pieces in splits(text):
        got = feed(parser("hermes"), pieces)
        assert got.result_content == text and got.result_calls == []
        assert got.calls[0]["arguments"] == '{"q": "unfini'
    # Cut before the name: nothing was sent as a call, all is content.
    got = feed(parser("hermes"), ['Hm. <tool_call>\n{"na'])
    assert got.content == got.result_content == 'Hm. <tool_call>\n{"na'
    assert not got.made


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = CASES[1][1]
    for pieces in splits(text):
        got = feed(parser("hermes", max_calls=1), pieces)
        assert got.result_calls == [(WEATHER, {"location": "Paris"})]
        assert len(got.calls) == 1


def test_calls_only_to_the_named_functions() -> None:
    text = '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>'
    got = feed(parser("hermes", names=frozenset({WEATHER})), [text])
    assert got.result_content == text and not got.made
    got = feed(parser("hermes", names=None), [text])
    assert got.result_calls == [("search", {})]


def test_no_parser_no_work() -> None:
    assert output_parser() is None
    assert output_parser(reasoning_parser="qwen3", separate_reasoning=False) is None


def test_names() -> None:
    assert {"hermes", "qwen25", "llama3", "llama3_json", "mistral"} <= set(TOOL_CALL_PARSER_NAMES)
    check_parser_names("hermes", "deepseek-r1")
    with pytest.raises(ValueError, match="known: hermes, llama3, llama3_json, mistral"):
        check_parser_names("pythonic", None)
    with pytest.raises(ValueError, match="known: deepseek-r1, minimax, qwen3"):
        check_parser_names(None, "r1")


def test_the_config_refuses_unknown_names_at_start() -> None:
    from actors.serving.root import load_config

    cfg = load_config(None, {"backend": "mock", "tool_call_parser": "llama3_json"})
    assert cfg.tool_call_parser == "llama3_json" and cfg.reasoning_parser is None
    with pytest.raises(ValueError, match=r"unknown tool-call parser 'hermes2' \(known: hermes"):
        load_config(None, {"backend": "mock", "tool_call_parser": "hermes2"})
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        load_config(None, {"backend": "mock", "reasoning_parser": "o1"})
