"""Structured output through the whole serving path (mock engines in child processes, the
`openai` client): every seeded answer under a JSON schema parses and validates against it,
streamed and not; regex and EBNF constrain chat and completions alike."""

from __future__ import annotations

import json
import re
from typing import Any

import anyio
import httpx
import jsonschema_rs
import openai

from tests.helpers.openai_streams import OPENAI_STREAMS
from tests.helpers.serving import serving_tree

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "kind": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}
FORMAT: Any = {  # (Any: the openai client's TypedDicts)
    "type": "json_schema",
    "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True},
}
MESSAGES: Any = [{"role": "user", "content": "Describe a pet."}]
ASK: Any = {  # every seeded request's arguments but its seed
    "model": "mock",
    "messages": MESSAGES,
    "response_format": FORMAT,
    "temperature": 1.0,
    "max_tokens": 2000,
}


@OPENAI_STREAMS
async def test_a_hundred_seeded_answers_all_validate_streamed_and_not() -> None:
    validator = jsonschema_rs.validator_for(SCHEMA)
    async with serving_tree(mode="aggregated", decode_workers=2) as tree:
        async with openai.AsyncOpenAI(
            base_url=f"{tree.url}/v1", api_key="unused", max_retries=0
        ) as client:
            answers: dict[int, str] = {}

            async def unary(seed: int) -> None:
                answer = await client.chat.completions.create(**ASK, seed=seed)
                choice = answer.choices[0]
                assert choice.finish_reason == "stop", (seed, choice)
                answers[seed] = choice.message.content or ""

            async def streamed(seed: int) -> None:
                text, finish = "", None
                stream = await client.chat.completions.create(**ASK, seed=seed, stream=True)
                async for chunk in stream:
                    if chunk.choices:
                        text += chunk.choices[0].delta.content or ""
                        finish = chunk.choices[0].finish_reason or finish
                assert finish == "stop", (seed, text)
                answers[seed] = text

            for first in range(0, 100, 20):
                async with anyio.create_task_group() as tg:
                    for seed in range(first, first + 20):
                        tg.start_soon(streamed if seed % 2 else unary, seed)
    assert len(answers) == 100
    for seed, text in answers.items():
        assert validator.is_valid(json.loads(text)), (seed, text)
    assert len(set(answers.values())) > 50  # seeded sampling: the answers differ


async def test_regex_and_ebnf_on_chat_and_completions() -> None:
    pattern = r"(yes|no), [0-9]{2} times"
    grammar = 'root ::= "colour: " ("red" | "green" | "blue")'
    async with serving_tree(mode="aggregated", decode_workers=1) as tree:
        async with openai.AsyncOpenAI(
            base_url=f"{tree.url}/v1", api_key="unused", max_retries=0
        ) as client:
            chat = await client.chat.completions.create(
                model="mock",
                messages=MESSAGES,
                max_tokens=50,
                seed=3,
                extra_body={"regex": pattern},
            )
            completion = await client.completions.create(
                model="mock", prompt="Pick one", max_tokens=50, seed=4, extra_body={"ebnf": grammar}
            )
    assert re.fullmatch(pattern, chat.choices[0].message.content or "")
    assert chat.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"colour: (red|green|blue)", completion.choices[0].text)


async def test_a_grammar_the_engine_refuses_is_a_400_in_every_mode() -> None:
    # In a disaggregated pair the prefill engine refuses it first: that refusal is the answer
    # (not a KV transfer that never comes, then migrations).
    for mode in ("aggregated", "disaggregated"):
        async with serving_tree(mode=mode, decode_workers=1, prefill_workers=1) as tree:
            async with httpx.AsyncClient(base_url=tree.url) as client:
                for bad in ({"ebnf": ""}, {"regex": "(unclosed"}):
                    body = {"model": "mock", "prompt": [8432, 8296, 268], **bad}
                    r = await client.post("/v1/completions", json=body, timeout=30)
                    assert r.status_code == 400, (mode, bad, r.text)
                    assert r.json()["error"]["code"] == "request.invalid", r.text
