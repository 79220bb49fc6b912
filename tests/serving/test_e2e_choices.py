"""Several choices per request through the whole serving path (mock engines in child processes,
real HTTP): each choice is its own engine request, so each migrates on its own."""

from __future__ import annotations

import json
import os
import signal
from collections import defaultdict
from typing import Any

import anyio
import httpx

from tests.helpers.serving import serving_tree


async def _choices(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """A streamed completion's choices by index: text, finish reason, logprobs (joined), and
    the stream's usage and error event (under index -1)."""
    found: dict[int, dict[str, Any]] = defaultdict(lambda: {"text": "", "logprobs": {}})
    async with client.stream("POST", "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                found[-1]["error"] = event["error"]
                continue
            if event.get("usage"):
                found[-1]["usage"] = event["usage"]
            for choice in event["choices"]:
                own = found[choice["index"]]
                own["text"] += choice["text"]
                own["finish"] = choice["finish_reason"] or own.get("finish")
                for field, values in (choice["logprobs"] or {}).items():
                    own["logprobs"].setdefault(field, []).extend(values)
    return dict(found)


SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "words": {"type": "array", "items": {}}},
    "required": ["title", "words"],
}


async def test_n_choices_differ_repeat_and_each_migrates_on_its_own() -> None:
    # Three choices with logprobs under a JSON schema: each continues from its own tokens, its
    # grammar replayed over them, its logprobs with no gap or repeat.
    body = {
        "model": "mock",
        "prompt": "tell me something long",
        "max_tokens": 120,
        "n": 3,
        "seed": 11,
        "temperature": 1.0,
        "logprobs": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with serving_tree(
        mode="aggregated",
        decode_workers=2,
        router="round_robin",
        engine_args={"timing": {"speedup": 1.0}},
    ) as tree:
        async with httpx.AsyncClient(base_url=tree.url) as client:
            baseline = await _choices(client, body)
            victim = await tree.engine_stats("decode-0")
            faulted: dict[int, dict[str, Any]] = {}
            async with anyio.create_task_group() as tg:

                async def run() -> None:
                    faulted.update(await _choices(client, body))

                tg.start_soon(run)
                # Round robin: some of the three choices run on decode-0.
                with anyio.fail_after(30):
                    while (await tree.engine_stats("decode-0")).running < 1:
                        await anyio.sleep(0.01)
                os.kill(victim.pid, signal.SIGKILL)
    texts = [baseline[i]["text"] for i in range(3)]
    assert len(set(texts)) == 3  # seeds of their own: the choices differ
    assert "error" not in faulted[-1], faulted[-1]
    for i in range(3):
        assert faulted[i]["text"] == baseline[i]["text"], i
        assert faulted[i]["logprobs"] == baseline[i]["logprobs"], i
        assert faulted[i]["finish"] == baseline[i]["finish"], i
        if baseline[i]["finish"] == "stop":  # the schema's object closed
            answer = json.loads(baseline[i]["text"])
            assert set(answer) >= {"title", "words"}, answer
    usage, expected = faulted[-1]["usage"], baseline[-1]["usage"]
    assert usage["completion_tokens"] == expected["completion_tokens"]
    assert usage["prompt_tokens"] == expected["prompt_tokens"]


async def test_a_batch_with_n_echo_and_prompt_logprobs() -> None:
    prompts = ["first prompt", "the second one"]
    body = {"model": "mock", "prompt": prompts, "n": 2, "max_tokens": 6}
    async with serving_tree(mode="aggregated", decode_workers=1) as tree:
        async with httpx.AsyncClient(base_url=tree.url) as client:
            r = await client.post(
                "/v1/completions", json={**body, "echo": True, "logprobs": 1}, timeout=60
            )
            best = await client.post(
                "/v1/completions", json={**body, "best_of": 3, "temperature": 1.0}, timeout=60
            )
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == 4 * 6
    for choice in choices:
        prompt = prompts[choice["index"] // 2]
        assert choice["text"].startswith(prompt)
        logprobs = choice["logprobs"]
        # Every prompt token (BOS first, with no logprob), then the completion's six.
        assert len(logprobs["tokens"]) == len(prompt.encode()) + 1 + 6
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert all(isinstance(lp, float) for lp in logprobs["token_logprobs"][1:])
        offsets = logprobs["text_offset"]
        assert offsets == sorted(offsets) and offsets[-1] < len(choice["text"])
        assert offsets[len(prompt.encode()) + 1] == len(prompt)  # the completion's first
    assert usage["prompt_tokens"] == sum(len(p.encode()) + 1 for p in prompts)
    assert best.status_code == 200, best.text
    assert [c["index"] for c in best.json()["choices"]] == [0, 1, 2, 3]
    assert best.json()["usage"]["completion_tokens"] == 2 * 3 * 6
