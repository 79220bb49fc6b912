"""Logprobs over HTTP: chat's and completions' (legacy) shapes, streamed and not, the openai
client reading them, and the fields' limits."""

from __future__ import annotations

from typing import Any

import httpx
import openai

from actors.serving.testing import ANSWER, MODEL, FakeBackend
from tests.frontend._http import CHAT, COMPLETIONS, chat_body, chunks

ANSWER_BYTES = list(ANSWER.encode())


async def _post(base_url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base_url) as client:
        return await client.post(path, json=body)


async def test_chat_logprobs_streamed_and_not(base_url: str, backend: FakeBackend) -> None:
    body = chat_body(logprobs=True, top_logprobs=2)
    whole = (await _post(base_url, CHAT, body)).json()["choices"][0]["logprobs"]
    assert backend.requests[0].logprobs == 2
    assert whole["refusal"] is None
    content = whole["content"]
    # One entry per token: its bytes, the answer's, in order; each the most likely of its top 2.
    assert [b for entry in content for b in entry["bytes"]] == ANSWER_BYTES
    assert content[0] == {
        "token": "H",
        "logprob": -0.25,
        "bytes": [72],
        "top_logprobs": [
            {"token": "H", "logprob": -0.25, "bytes": [72]},
            {"token": "I", "logprob": -1.25, "bytes": [73]},
        ],
    }
    # "é" is two byte tokens: each reads as an escape, the bytes say what it is.
    assert [e["token"] for e in content[1:3]] == ["\\xc3", "\\xa9"]

    events = chunks((await _post(base_url, CHAT, {**body, "stream": True})).text)
    assert events[0]["choices"][0]["logprobs"] is None  # the role's chunk
    streamed = [
        e
        for c in events
        if c["choices"][0]["logprobs"]
        for e in c["choices"][0]["logprobs"]["content"]
    ]
    assert streamed == content


async def test_chat_without_logprobs_says_null(base_url: str, backend: FakeBackend) -> None:
    r = await _post(base_url, CHAT, chat_body(top_logprobs=0))
    assert r.json()["choices"][0]["logprobs"] is None
    assert backend.requests[0].logprobs is None


async def test_completion_logprobs_streamed_and_not(base_url: str) -> None:
    body = {"model": MODEL, "prompt": "hi", "logprobs": 1, "max_tokens": 5}
    whole = (await _post(base_url, COMPLETIONS, body)).json()["choices"][0]
    assert whole["text"] == "Héll"
    assert whole["logprobs"] == {
        "tokens": ["H", "\\xc3", "\\xa9", "l", "l"],
        "token_logprobs": [-0.25] * 5,
        # The top 1 is the chosen token itself (else it would come as a second entry).
        "top_logprobs": [
            {"H": -0.25},
            {"\\xc3": -0.25},
            {"\\xa9": -0.25},
            {"l": -0.25},
            {"l": -0.25},
        ],
        "text_offset": [0, 1, 2, 2, 3],  # where each token's text starts in "Héll"
    }
    events = chunks((await _post(base_url, COMPLETIONS, {**body, "stream": True})).text)
    parts = [c["choices"][0]["logprobs"] for c in events if c["choices"][0]["logprobs"]]
    assert {key: [v for p in parts for v in p[key]] for key in parts[0]} == whole["logprobs"]


async def test_completion_logprobs_zero_still_give_the_chosen_token(base_url: str) -> None:
    body = {"model": MODEL, "prompt": "hi", "logprobs": 0, "max_tokens": 1}
    logprobs = (await _post(base_url, COMPLETIONS, body)).json()["choices"][0]["logprobs"]
    assert logprobs["top_logprobs"] == [{"H": -0.25}]


async def test_logprobs_limits(base_url: str) -> None:
    refused = [
        (CHAT, chat_body(top_logprobs=2), "top_logprobs"),  # without logprobs: true
        (COMPLETIONS, {"model": MODEL, "prompt": "hi", "logprobs": 6}, "logprobs"),
    ]
    async with httpx.AsyncClient(base_url=base_url) as client:
        for path, body, param in refused:
            r = await client.post(path, json=body)
            assert r.status_code == 400
            assert r.json()["error"]["param"] == param


async def test_the_openai_client_reads_them(base_url: str) -> None:
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0) as c:
        chat = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            logprobs=True,
            top_logprobs=1,
        )
        completion = await c.completions.create(model=MODEL, prompt="hi", max_tokens=3, logprobs=2)
    logprobs = chat.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [t.bytes for t in logprobs.content] == [[72], [195], [169]]
    assert logprobs.content[0].top_logprobs[0].token == "H"
    legacy = completion.choices[0].logprobs
    assert legacy is not None and legacy.text_offset == [0, 1, 2]
    assert legacy.top_logprobs is not None and legacy.top_logprobs[0] == {"H": -0.25, "I": -1.25}
