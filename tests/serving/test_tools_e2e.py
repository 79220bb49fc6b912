"""Tool calls through the whole serving path: mock engines behind ``--tool-call-parser hermes``,
the openai client; a forced call is made by the engine's grammar mask and read back as a call."""

from __future__ import annotations

import getpass
import json
import os
import tempfile
from typing import Any

import anyio
import openai
import pytest

from tests.helpers.serving import serving_tree

WEATHER: Any = {  # (Any: the openai client's TypedDicts)
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME: Any = {"type": "function", "function": {"name": "get_time"}}


async def test_forced_calls_on_the_mock_engine() -> None:
    async with serving_tree(mode="aggregated", decode_workers=1, tool_call_parser="hermes") as tree:

        def use_client() -> list[Any]:
            client = openai.OpenAI(base_url=f"{tree.url}/v1", api_key="unused", max_retries=0)
            messages: list[Any] = [{"role": "user", "content": "What is the weather in Oslo?"}]
            out: list[Any] = []
            for seed in range(4):
                answer = client.chat.completions.create(
                    model="mock",
                    messages=messages,
                    tools=[WEATHER, TIME],
                    tool_choice={"type": "function", "function": {"name": "get_weather"}},
                    seed=seed,
                    max_tokens=400,
                )
                out.append(answer.choices[0])
            calls: dict[int, dict[str, str]] = {}
            finish = None
            for chunk in client.chat.completions.create(
                model="mock",
                messages=messages,
                tools=[WEATHER, TIME],
                tool_choice="required",
                max_tokens=400,
                stream=True,
            ):
                for choice in chunk.choices:
                    for call in choice.delta.tool_calls or []:
                        assert call.function is not None
                        entry = calls.setdefault(call.index, {"name": "", "args": ""})
                        entry["name"] += call.function.name or ""
                        entry["args"] += call.function.arguments or ""
                    finish = choice.finish_reason or finish
            out.append((calls, finish))
            # The call and its result go back into the prompt for the next turn.
            first = out[0].message.tool_calls[0]
            messages += [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": first.id,
                            "type": "function",
                            "function": {
                                "name": first.function.name,
                                "arguments": first.function.arguments,
                            },
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": first.id, "content": "sunny, 18 degrees"},
            ]
            final = client.chat.completions.create(
                model="mock", messages=messages, tools=[WEATHER, TIME], max_tokens=8
            )
            out.append(final.choices[0])
            client.close()
            return out

        *forced, (streamed, finish), final = await anyio.to_thread.run_sync(use_client)
    for choice in forced:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.id.startswith("call_") and call.function.name == "get_weather"
        arguments = json.loads(call.function.arguments)
        assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    assert finish == "tool_calls" and streamed
    for entry in streamed.values():
        assert entry["name"] in ("get_weather", "get_time")
        assert isinstance(json.loads(entry["args"]), dict)
    assert final.finish_reason in ("stop", "length", "tool_calls")


@pytest.fixture(scope="module")
def inductor_cache() -> None:
    """torch's inductor cache folder in the run's temporary directory, made before the test (as
    test_hf_serving's in-process model does): the engine process makes it on first use, and it
    stays for the run, no leak of the test's."""
    os.makedirs(
        os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"), exist_ok=True
    )


@pytest.mark.slow
@pytest.mark.usefixtures("inductor_cache")
async def test_smollm2_makes_the_forced_call_and_may_answer_freely() -> None:
    # Arguments from enums only, so the forced call has a bounded length on a tiny model.
    bounded: Any = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"enum": ["Paris", "Oslo", "Lima"]},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    }
    hf: dict[str, Any] = {
        "backend": "hf",
        "mode": "aggregated",
        "decode_workers": 1,
        "engine_args": {"num_threads": 1, "kv_cache_tokens": 4096},
        "heartbeat_timeout": 30.0,
        "health_idle_after": 120.0,
        "tool_call_parser": "hermes",
    }
    async with serving_tree(ready_timeout=120, **hf) as tree:
        model = tree.serving.config.model

        def ask() -> tuple[Any, Any, Any]:
            client = openai.OpenAI(base_url=f"{tree.url}/v1", api_key="unused", max_retries=0)
            messages: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
            forced = client.chat.completions.create(
                model=model,
                messages=messages,
                tools=[bounded],
                tool_choice="required",
                parallel_tool_calls=False,  # (greedy, a tiny model would call again and again)
                temperature=0,
                max_tokens=60,
            )
            streamed = list(
                client.chat.completions.create(
                    model=model,
                    messages=messages,
                    tools=[bounded],
                    tool_choice={"type": "function", "function": {"name": "get_weather"}},
                    temperature=0,
                    max_tokens=60,
                    stream=True,
                )
            )
            free = client.chat.completions.create(
                model=model, messages=messages, tools=[bounded], temperature=0, max_tokens=24
            )
            client.close()
            return forced, streamed, free

        forced, streamed, free = await anyio.to_thread.run_sync(ask)
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert arguments["city"] in ("Paris", "Oslo", "Lima")
    args = "".join(
        c.function.arguments or ""
        for chunk in streamed
        for ch in chunk.choices
        for c in ch.delta.tool_calls or []
    )
    assert json.loads(args) == arguments  # greedy: the same call, streamed
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
    assert free.choices[0].finish_reason in ("stop", "length", "tool_calls")
