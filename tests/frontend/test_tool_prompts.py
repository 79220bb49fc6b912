"""Tools into the prompt (chat templates, ours where the model's has no tools) and the grammars
that force calls."""

from __future__ import annotations

import json
from typing import Any

import pytest

from actors.serving.frontend import ByteTokenizer, HFTokenizer, Tokenizer
from actors.serving.frontend._openai_types import ChatCompletionRequest
from actors.serving.frontend._parsers import output_parser, tool_format
from actors.serving.frontend._parsers._chat import template_messages, tool_plan
from protocols.engine import Grammar
from protocols.errors import InvalidRequest
from tests.frontend._hf import build_tokenizer_folder

from ._parsing import feed

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"},
            },
            "required": ["city"],
        },
    },
}
SEARCH: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {
                "q": {"type": "string"},
                "filters": {"type": "array", "items": {"type": ["string", "null"]}},
                "exact": {"type": "boolean"},
                "score": {"anyOf": [{"type": "number"}, {"const": "any"}]},
            },
        },
    },
}
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    {"role": "user", "content": "And in Tokyo?"},
]

# A Qwen2.5-like template that renders tools, calls and results itself.
NATIVE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{%- for tool in tools %}\n"
    "{{ tool | tojson }}{%- endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant"
    "{%- for c in m.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": CONVERSATION, "tools": [WEATHER, SEARCH], **fields}
    )


def prompt_text(tokenizer: Tokenizer, body: ChatCompletionRequest, parser: str | None) -> str:
    plan = tool_plan(body, parser)
    messages, tools = template_messages(body.messages, plan, native=tokenizer.renders_tools)
    ids = tokenizer.apply_chat_template(messages, tools=tools)
    return tokenizer.decode(ids)


@pytest.fixture(scope="module")
def smollm2() -> HFTokenizer:
    from actors.serving.engines import find_smollm2

    return HFTokenizer.from_pretrained(find_smollm2().folder)


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    from transformers import AutoTokenizer

    folder = build_tokenizer_folder(tmp_path_factory.mktemp("tok"))
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    tok.chat_template = NATIVE_TEMPLATE
    return HFTokenizer(tok)


def _written_by_us(text: str, parser: str) -> None:
    """The tools, the parser's call format and the history, written into the messages."""
    assert "You are terse.\n\n" in text  # the conversation's own system message comes first
    assert '"name": "get_weather", "description": "The weather in a city."' in text
    fmt = tool_format(parser)
    assert fmt.render_calls([("get_weather", {"city": "Paris"})]) in text
    assert fmt.render_result('{"temp_c": 21}', None) in text
    assert text.index("Weather in Paris?") < text.index('{"temp_c": 21}') < text.index("Tokyo")


@pytest.mark.parametrize("parser", ["hermes", "llama3", "mistral"])
def test_smollm2_gets_tools_written_into_the_messages(smollm2: HFTokenizer, parser: str) -> None:
    assert not smollm2.renders_tools  # its template never mentions tools
    text = prompt_text(smollm2, request(), parser)
    _written_by_us(text, parser)
    assert "You are a helpful AI assistant named SmolLM" not in text  # (ours is the system one)


@pytest.mark.parametrize("parser", ["hermes", "mistral"])
def test_byte_tokenizer_gets_tools_written_into_the_messages(parser: str) -> None:
    tok = ByteTokenizer()
    text = prompt_text(tok, request(), parser)
    _written_by_us(text, parser)
    assert text.startswith("<|system|>\nYou are terse.")
    assert "<|user|>\n<tool_response>" in text or "<|user|>\n[TOOL_RESULTS]" in text


def test_a_template_with_tools_renders_them_itself(native: HFTokenizer) -> None:
    assert native.renders_tools
    text = prompt_text(native, request(), "hermes")
    assert text.count('"name": "get_weather"') == 2  # the tool, and the call in the history
    assert "# Tools" in text and "<tool_call>" in text and "<tool_response>" in text
    assert '"arguments": {"city": "Paris"}' in text  # arguments as an object, not a string
    assert "You may call one or more functions" not in text  # nothing of ours


def test_tool_choice_none_shows_no_tools_where_we_would_write_them(smollm2: HFTokenizer) -> None:
    text = prompt_text(smollm2, request(tool_choice="none"), None)
    assert "get_weather" in text  # the history's call, written in the default format
    assert '"description"' not in text


def test_tools_without_a_parser_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="--tool-call-parser") as info:
        tool_plan(request(), None)
    assert getattr(info.value, "param", None) == "tools"
    assert tool_plan(request(tool_choice="none"), None).parser is None


def test_forced_calls_with_another_grammar_are_refused() -> None:
    body = request(tool_choice="required", regex="[a-z]+")
    with pytest.raises(InvalidRequest) as info:
        tool_plan(body, "hermes")
    assert getattr(info.value, "param", None) == "tool_choice"


def test_the_plan() -> None:
    assert tool_plan(request(), "hermes").grammar is None  # auto: no constraint
    plan = tool_plan(request(parallel_tool_calls=False), "hermes")
    assert plan.max_calls == 1 and plan.names == frozenset({"get_weather", "search"})
    named = tool_plan(
        request(tool_choice={"type": "function", "function": {"name": "search"}}), "hermes"
    )
    assert named.names == frozenset({"search"}) and named.max_calls == 1
    assert named.grammar is not None
    assert "search" in named.grammar.spec and "get_weather" not in named.grammar.spec


# --- the grammars --------------------------------------------------------------------------


def _llguidance_accepts(grammar: Grammar, text: str) -> bool:
    from actors.serving.engines._grammar import Vocabulary

    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    vocab = Vocabulary.from_token_bytes(tokens, eos_token_id=256)
    matcher = vocab.matcher(grammar)
    return all(matcher.accept(b) for b in text.encode()) and matcher.accepting


def _xgrammar_accepts(grammar: Grammar, text: str) -> bool:
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    return bool(_is_grammar_accept_string(xgrammar.Grammar.from_ebnf(grammar.spec), text))


def _call(parser: str, *calls: tuple[str, dict[str, Any]]) -> str:
    return (
        tool_format(parser).render_calls(list(calls))
        if parser != "mistral"
        else (tool_format(parser).render_calls(list(calls)).removeprefix("[TOOL_CALLS]"))
    )


TOOLS: list[dict[str, Any]] = [WEATHER, SEARCH]
GOOD: list[tuple[str, dict[str, Any]]] = [
    ("get_weather", {"city": "Paris"}),
    ("get_weather", {"city": "Paris", "unit": "celsius", "days": 3}),
    ("get_weather", {"city": 'Tōkyō "x"\n', "days": -12}),
    ("search", {}),
    ("search", {"q": "x", "filters": ["a", None], "exact": True, "score": 0.5}),
    ("search", {"exact": False, "score": "any"}),
]
BAD: list[tuple[str, dict[str, Any]]] = [
    ("get_weather", {}),  # city is required
    ("get_weather", {"city": 3}),
    ("get_weather", {"city": "Paris", "unit": "kelvin"}),
    ("get_weather", {"city": "Paris", "days": 1.5}),
    ("search", {"filters": [1]}),
    ("search", {"q": "x", "other": 1}),
    ("delete_everything", {}),
]


@pytest.mark.parametrize("parser", ["hermes", "llama3", "mistral"])
@pytest.mark.parametrize("accepts", [_llguidance_accepts, _xgrammar_accepts])
def test_the_grammar_takes_valid_calls_only(parser: str, accepts: Any) -> None:
    from actors.serving.frontend._parsers._types import ToolSpec

    fmt = tool_format(parser)
    specs = [ToolSpec(t["function"]["name"], None, t["function"]["parameters"]) for t in TOOLS]
    one = fmt.grammar(specs, parallel=False)
    many = fmt.grammar(specs, parallel=True)
    assert one.kind == many.kind == "ebnf"
    for call in GOOD:
        text = _call(parser, call)
        assert accepts(one, text), text
        assert accepts(many, text), text
        # What the grammar lets out, the parser reads as that call.
        p = output_parser(tool_parser=parser)
        assert p is not None
        got = feed(p, list(text))
        assert got.result_calls == [call] and got.result_content is None
    for call in BAD:
        text = _call(parser, call)
        assert not accepts(one, text), text
    two = _call(parser, GOOD[0], GOOD[3])
    assert accepts(many, two) and not accepts(one, two)
    assert not accepts(one, "Sure, " + _call(parser, GOOD[0]))  # nothing but the call
    assert not accepts(one, "")


def test_arguments_json_round_trip() -> None:
    # Models see JSON as json.dumps writes it; the grammar allows it compact too.
    for call in GOOD:
        assert json.loads(json.dumps(call[1])) == call[1]
