"""``tool_choice`` required or named, on the mock engine: the parser's grammar makes every answer
a call of a given function, with arguments following its schema, which the parser reads back."""

from __future__ import annotations

import json
from typing import Any

import jsonschema_rs
import msgspec
import pytest

from actors.serving.engines import MockEngine
from actors.serving.frontend import ByteTokenizer
from actors.serving.frontend._parsers import ToolSpec, output_parser, tool_format
from protocols import byte_vocab
from protocols.engine import SamplingOptions
from tests.engines._mock_helpers import config, request, run

from ._parsing import feed

TOOLS = [
    ToolSpec(
        "get_weather",
        "The weather in a city.",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"},
            },
            "required": ["city", "unit"],
        },
    ),
    ToolSpec("now", None, None),
    ToolSpec(
        "search",
        None,
        {
            "type": "object",
            "properties": {"q": {"type": "string"}, "tags": {"type": "array", "items": {}}},
            "required": ["q"],
        },
    ),
]
SCHEMAS = {t.name: t.parameters or {"type": "object"} for t in TOOLS}


@pytest.mark.parametrize("parser", ["hermes", "llama3", "mistral"])
@pytest.mark.parametrize("parallel", [False, True])
async def test_every_answer_is_a_call(parser: str, parallel: bool) -> None:
    grammar = tool_format(parser).grammar(TOOLS, parallel=parallel)
    tokenizer = ByteTokenizer()
    names: set[str] = set()
    async with MockEngine(config(eos_token_id=byte_vocab.EOS)) as engine:
        for seed in range(12):
            req = request(f"r{seed}", list(b"Call a tool:"), max_tokens=600)
            req = msgspec.structs.replace(
                req,
                eos_token_ids=[byte_vocab.EOS],
                sampling_options=SamplingOptions(
                    guided_decoding=grammar, temperature=1.0, seed=seed
                ),
            )
            tokens, last = await run(engine, req)
            assert last.finish_reason == "stop"
            text = tokenizer.decode(tokens)
            p = output_parser(tool_parser=parser, tool_names={t.name for t in TOOLS})
            assert p is not None
            got = feed(p, [text[i : i + 3] for i in range(0, len(text), 3)])
            assert got.result_content is None, text
            assert got.made and got.result_calls, text
            assert parallel or len(got.result_calls) == 1
            for name, arguments in got.result_calls:
                jsonschema_rs.validator_for(_closed(SCHEMAS[name])).validate(arguments)
                names.add(name)
    assert len(names) >= 2  # the seeds pick different functions


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema as the grammar enforces it: no properties beyond those it names."""
    out: dict[str, Any] = json.loads(json.dumps(schema))
    if out.get("properties"):
        out["additionalProperties"] = False
    return out
