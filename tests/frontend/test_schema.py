"""The published OpenAPI schema and the server agree: the request bodies are published as their
models state them, a field we do not implement says what it accepts (and is refused, naming it,
for anything else), and a whole number is an integer however it is written."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel

from actors.serving.frontend._openai_types import ChatCompletionRequest, CompletionRequest
from actors.serving.testing import MODEL
from tests.frontend._http import CHAT, COMPLETIONS, chat_body

JSON = {"content-type": "application/json"}
MODELS: dict[str, type[BaseModel]] = {CHAT: ChatCompletionRequest, COMPLETIONS: CompletionRequest}


def _body(path: str, **fields: Any) -> dict[str, Any]:
    if path == CHAT:
        return chat_body(**fields)
    return {"model": MODEL, "prompt": "hi", **fields}


def test_request_bodies_are_published_as_their_models_state_them(app: FastAPI) -> None:
    published = app.openapi()["components"]["schemas"]
    for model in MODELS.values():
        exact = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, schema in exact.pop("$defs", {}).items():
            assert published[name] == schema, name
        assert published[model.__name__] == exact
    # A bound above 2**53 stays exact (FastAPI's own rendering made 2**63 - 1 the float 2**63).
    top_k = published["CompletionRequest"]["properties"]["top_k"]["anyOf"][0]
    assert top_k["maximum"] == 2**63 - 1 and isinstance(top_k["maximum"], int)


#: Fields (OpenAI's, vLLM's, SGLang's) that would change the answer and that we do not implement:
#: the values they accept (those that change nothing), and a value they refuse.
NOT_IMPLEMENTED = [
    (COMPLETIONS, "suffix", [None, ""], "and then"),
    (CHAT, "functions", [None], [{"name": "f", "parameters": {}}]),
    (CHAT, "function_call", [None], "auto"),
    (CHAT, "audio", [None], {"voice": "alloy", "format": "wav"}),
    (CHAT, "modalities", [None, ["text"]], ["text", "audio"]),
    (CHAT, "web_search_options", [None], {}),
    (CHAT, "echo", [False], True),
    (CHAT, "continue_final_message", [False], True),
    (CHAT, "add_generation_prompt", [True], False),
    (CHAT, "chat_template", [None], "{{ messages }}"),
    (CHAT, "guided_json", [None], {"type": "object"}),
    (COMPLETIONS, "guided_regex", [None], "a+"),
    (COMPLETIONS, "guided_choice", [None], ["a", "b"]),
    (CHAT, "guided_grammar", [None], 'root ::= "a"'),
    (CHAT, "structured_outputs", [None], {"regex": "a+"}),
    (COMPLETIONS, "use_beam_search", [False], True),
    (CHAT, "skip_special_tokens", [True], False),
    (COMPLETIONS, "include_stop_str_in_output", [False], True),
    (CHAT, "return_hidden_states", [False], True),
    (COMPLETIONS, "prompt_logprobs", [None], 1),
    (CHAT, "truncate_prompt_tokens", [None], 10),
    (COMPLETIONS, "lora_path", [None], "adapter"),
    (COMPLETIONS, "json_schema", [None], '{"type": "object"}'),
    (CHAT, "bad_words", [None], ["no"]),
    (COMPLETIONS, "allowed_token_ids", [None], [1, 2]),
    (CHAT, "custom_logit_processor", [None], "processor"),
    (CHAT, "best_of", [None, 1], 2),
]


@pytest.mark.parametrize(
    ("path", "field", "accepted", "refused"),
    NOT_IMPLEMENTED,
    ids=[f"{p}:{f}" for p, f, *_ in NOT_IMPLEMENTED],
)
async def test_a_field_we_do_not_implement_says_what_it_accepts(
    base_url: str, path: str, field: str, accepted: list[Any], refused: Any
) -> None:
    schema = MODELS[path].model_json_schema()["properties"][field]
    assert schema["description"].startswith("only ")
    if "enum" in schema:
        assert schema["enum"] == accepted
    async with httpx.AsyncClient(base_url=base_url) as client:
        for value in accepted:
            ok = await client.post(path, json=_body(path, **{field: value}))
            assert ok.status_code == 200, (value, ok.text)
        r = await client.post(path, json=_body(path, **{field: refused}))
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (field, "unsupported_value")
    assert error["message"] == f"{field}: {schema['description']}"


#: Raw JSON fragments for a completion body, and the field a refusal names (``None``: served).
NUMBERS = [
    ('"max_tokens": 8.0', None),
    ('"max_tokens": 8e0', None),
    ('"max_tokens": 0.8e1', None),
    ('"n": 1.0', None),
    ('"stop_token_ids": [7.0, 2e0]', None),
    ('"seed": 18446744073709551615.0', None),  # 2**64 - 1: exact, not rounded to 2**64
    ('"prompt": [72.0, 105.0]', None),
    ('"temperature": 1', None),  # and an int where a number goes
    ('"max_tokens": 8.5', "max_tokens"),
    ('"max_tokens": 8.0000000000000001', "max_tokens"),  # a float would round it to 8
    ('"seed": 18446744073709551616.0', "seed"),
    ('"seed": 1e400', "seed"),
]


@pytest.mark.parametrize(("fragment", "param"), NUMBERS, ids=[n[0] for n in NUMBERS])
async def test_a_whole_number_is_an_integer_however_it_is_written(
    base_url: str, fragment: str, param: str | None
) -> None:
    raw = f'{{"model": "{MODEL}", "prompt": "hi", {fragment}}}'
    async with httpx.AsyncClient(base_url=base_url) as client:
        r = await client.post(COMPLETIONS, content=raw, headers=JSON)
    if param is None:
        assert r.status_code == 200, r.text
        if "max_tokens" in fragment:
            assert r.json()["usage"]["completion_tokens"] <= 8
    else:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
