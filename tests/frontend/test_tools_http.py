"""Tools and reasoning through the HTTP API, with the openai client: a scripted model (the fake
backend answers by the conversation so far) on a server with ``--tool-call-parser hermes`` and
``--reasoning-parser qwen3``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI
from openai.types.chat import ChatCompletionMessageFunctionToolCall
from prometheus_client import CollectorRegistry

from actors.serving.frontend import ByteTokenizer, ModelInfo, create_app
from actors.serving.testing import CONTEXT, MODEL, FakeBackend
from protocols.engine import PreprocessedRequest
from tests.helpers.openai_streams import OPENAI_STREAMS

from .conftest import served

pytestmark = OPENAI_STREAMS

WEATHER: Any = {  # (Any: the openai client's TypedDicts)
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THINKING = "<think>\nThe user wants the weather: I call the tool.\n</think>\n\n"


class ScriptedBackend(FakeBackend):
    """A model with parsers, answering by what its prompt holds."""

    def __init__(self, tool_call_parser: str | None, reasoning_parser: str | None) -> None:
        super().__init__(ByteTokenizer())
        self.parsers = tool_call_parser, reasoning_parser
        self.answer_of = self._answer
        self.prompts: list[str] = []

    def models(self) -> list[ModelInfo]:
        tool, reasoning = self.parsers
        return [
            ModelInfo(
                MODEL,
                CONTEXT * 16,
                self.tokenizer,
                tool_call_parser=tool,
                reasoning_parser=reasoning,
            )
        ]

    def _answer(self, request: PreprocessedRequest) -> str:
        prompt = self.tokenizer.decode(request.token_ids)
        self.prompts.append(prompt)
        last = prompt.rsplit("<|user|>", 1)[-1]  # the last user message (tool results are)
        if "<tool_response>" in last:
            return "It is 21 °C in Paris."
        if "think first" in last:
            return THINKING + CALL
        if "weather" in last.lower():
            return "Let me check.\n" + CALL
        return "Hello!"


@pytest.fixture
def backend() -> ScriptedBackend:
    return ScriptedBackend("hermes", "qwen3")


@pytest.fixture
def app(backend: FakeBackend, registry: CollectorRegistry) -> FastAPI:
    return create_app(backend, registry)


@pytest.fixture
async def client(base_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0) as c:
        yield c


async def _streamed(client: openai.AsyncOpenAI, **kw: Any) -> dict[str, Any]:
    """A streamed chat answer put together: content, reasoning, calls by index, finish."""
    content, reasoning, finish = "", "", None
    calls: dict[int, dict[str, str]] = {}
    stream = await client.chat.completions.create(model=MODEL, stream=True, **kw)
    async for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or []:
                if call.id is not None:
                    assert call.index not in calls and call.type == "function"
                    assert call.function is not None and call.function.name
                    calls[call.index] = {"id": call.id, "name": call.function.name, "args": ""}
                assert call.function is not None
                calls[call.index]["args"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return {"content": content, "reasoning": reasoning, "calls": calls, "finish": finish}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tool_round_trip_over_several_turns(
    client: openai.AsyncOpenAI, backend: ScriptedBackend, stream: bool
) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    if stream:
        got = await _streamed(client, messages=messages, tools=[WEATHER])
        assert got["content"] == "Let me check." and got["finish"] == "tool_calls"
        [call] = got["calls"].values()
        call_id, name, arguments = call["id"], call["name"], call["args"]
    else:
        answer = await client.chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER]
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me check."
        [tool_call] = choice.message.tool_calls or []
        assert isinstance(tool_call, ChatCompletionMessageFunctionToolCall)
        call_id, name = tool_call.id, tool_call.function.name
        arguments = tool_call.function.arguments
    assert call_id.startswith("call_") and name == "get_weather"
    assert json.loads(arguments) == {"city": "Paris"}
    # The tools were written into the prompt (the mock's template has none of its own).
    assert "<tools>" in backend.prompts[-1] and '"name": "get_weather"' in backend.prompts[-1]

    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": '{"temp_c": 21}'},
    ]
    final = await client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    assert final.choices[0].message.content == "It is 21 °C in Paris."
    assert final.choices[0].finish_reason == "stop" and not final.choices[0].message.tool_calls
    prompt = backend.prompts[-1]
    assert CALL in prompt  # the assistant's call, as the model writes it
    assert '<tool_response>\n{"temp_c": 21}\n</tool_response>' in prompt
    messages.append({"role": "assistant", "content": final.choices[0].message.content})
    messages.append({"role": "user", "content": "Thanks! And hello."})
    last = await client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    assert last.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
async def test_reasoning_content(client: openai.AsyncOpenAI, stream: bool) -> None:
    messages: Any = [{"role": "user", "content": "think first, then get the weather"}]
    if stream:
        got = await _streamed(client, messages=messages, tools=[WEATHER])
        reasoning, content, finish = got["reasoning"], got["content"], got["finish"]
        assert [c["name"] for c in got["calls"].values()] == ["get_weather"]
    else:
        answer = await client.chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER]
        )
        message = answer.choices[0].message
        reasoning = (message.model_extra or {}).get("reasoning_content")
        content, finish = message.content or "", answer.choices[0].finish_reason
        [call] = message.tool_calls or []
        assert isinstance(call, ChatCompletionMessageFunctionToolCall)
        assert call.function.name == "get_weather"
    assert reasoning == "The user wants the weather: I call the tool.\n"
    assert content == "" and finish == "tool_calls"


async def test_separate_reasoning_false_keeps_it_in_content(client: openai.AsyncOpenAI) -> None:
    answer = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "think first"}],
        extra_body={"separate_reasoning": False},
    )
    message = answer.choices[0].message
    assert message.content == THINKING + CALL  # no tools: calls are not looked for either
    assert (message.model_extra or {}).get("reasoning_content") is None


async def test_plain_answers_stay_plain(client: openai.AsyncOpenAI) -> None:
    answer = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=[WEATHER]
    )
    assert answer.choices[0].message.content == "Hello!"
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].message.tool_calls is None
    got = await _streamed(client, messages=[{"role": "user", "content": "hi"}], tools=[WEATHER])
    assert got == {"content": "Hello!", "reasoning": "", "calls": {}, "finish": "stop"}


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
async def test_forced_calls_send_the_grammar(
    client: openai.AsyncOpenAI, backend: ScriptedBackend, choice: Any
) -> None:
    answer = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "weather?"}],
        tools=[WEATHER],
        tool_choice=choice,
        parallel_tool_calls=False,
    )
    assert answer.choices[0].finish_reason == "tool_calls"
    grammar = backend.requests[-1].sampling_options.guided_decoding
    assert grammar is not None and grammar.kind == "ebnf"
    assert "<tool_call>" in grammar.spec and "get_weather" in grammar.spec


async def test_refusals(base_url: str) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
    }
    async with httpx.AsyncClient(base_url=base_url) as http:
        response = await http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "tool_choice"


async def test_tools_need_a_parser(registry: CollectorRegistry) -> None:
    app = create_app(ScriptedBackend(None, None), registry)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "weather?"}]}
    async with served(app) as url, httpx.AsyncClient(base_url=url) as http:
        response = await http.post("/v1/chat/completions", json={**body, "tools": [WEATHER]})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "tools"
        assert "--tool-call-parser" in response.json()["error"]["message"]
        # tool_choice none: the tools are not used, and not refused.
        none = {**body, "tools": [WEATHER], "tool_choice": "none"}
        response = await http.post("/v1/chat/completions", json=none)
        assert response.status_code == 200
        assert "<tool_call>" in response.json()["choices"][0]["message"]["content"]


async def test_each_choice_has_its_own_parser(client: openai.AsyncOpenAI) -> None:
    messages: Any = [{"role": "user", "content": "think first, weather"}]
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], n=2, stream=True, logprobs=True
    )
    calls: dict[int, dict[int, str]] = {0: {}, 1: {}}
    reasoning = {0: "", 1: ""}
    finish: dict[int, str | None] = {}
    tokens = {0: 0, 1: 0}
    async for chunk in stream:
        for choice in chunk.choices:
            i = choice.index
            reasoning[i] += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            for call in choice.delta.tool_calls or []:
                assert call.function is not None
                calls[i][call.index] = calls[i].get(call.index, "") + (
                    call.function.arguments or ""
                )
            if choice.logprobs is not None and choice.logprobs.content:
                tokens[i] += len(choice.logprobs.content)
            finish[i] = choice.finish_reason or finish.get(i)
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    for i in (0, 1):
        assert reasoning[i] == "The user wants the weather: I call the tool.\n"
        assert [json.loads(args) for args in calls[i].values()] == [{"city": "Paris"}]
        assert tokens[i] == len((THINKING + CALL).encode())  # every token's logprob, once
