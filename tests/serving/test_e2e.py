"""The whole serving path against mock engines in child processes, through real HTTP."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import anyio
import httpx
import openai
import pytest

from tests.helpers.serving import serving_tree


async def _stream_text(
    client: httpx.AsyncClient,
    prompt: str,
    max_tokens: int,
    on_first: Callable[[], None] | None = None,
    on_chunk: Callable[[int], None] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """One streamed completion: its text, finish reason, usage, logprobs (each field's lists
    joined) and any error event (``on_chunk(n)`` after the n-th chunk with a choice)."""
    body = {
        "model": "mock",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    text, finish, usage, error, chunks = "", None, None, None, 0
    logprobs: dict[str, list[Any]] = {}
    async with client.stream("POST", "/v1/completions", json=body, timeout=60) as response:
        if response.status_code != 200:
            # Failed before the first output: an HTTP error in OpenAI's format.
            return {
                "text": "",
                "finish": None,
                "usage": None,
                "chunks": 0,
                "logprobs": logprobs,
                "error": json.loads(await response.aread())["error"],
                "status": response.status_code,
            }
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
                continue
            if on_first is not None and event.get("choices"):
                on_first()
                on_first = None
            for choice in event.get("choices", []):
                text += choice.get("text") or ""
                finish = choice.get("finish_reason") or finish
                for field, values in (choice.get("logprobs") or {}).items():
                    logprobs.setdefault(field, []).extend(values)
                chunks += 1
                if on_chunk is not None:
                    on_chunk(chunks)
            usage = event.get("usage") or usage
    return {
        "text": text,
        "finish": finish,
        "usage": usage,
        "logprobs": logprobs,
        "error": error,
        "chunks": chunks,
        "status": 200,
    }


async def test_openai_client_completions_and_chat() -> None:
    async with serving_tree(mode="aggregated", decode_workers=2) as tree:

        def use_client() -> tuple[Any, Any, str]:
            client = openai.OpenAI(base_url=f"{tree.url}/v1", api_key="unused", max_retries=0)
            completion = client.completions.create(model="mock", prompt="hello", max_tokens=8)
            chat = client.chat.completions.create(
                model="mock", messages=[{"role": "user", "content": "hi"}], max_tokens=6
            )
            streamed = "".join(
                chunk.choices[0].delta.content or ""
                for chunk in client.chat.completions.create(
                    model="mock",
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=6,
                    stream=True,
                )
                if chunk.choices
            )
            client.close()
            return completion, chat, streamed

        completion, chat, streamed = await anyio.to_thread.run_sync(use_client)
        assert completion.choices[0].finish_reason == "length"
        assert completion.usage.completion_tokens == 8
        assert completion.usage.prompt_tokens > 0
        assert chat.usage.completion_tokens == 6
        assert chat.choices[0].message.content == streamed  # same prompt, greedy: same answer


async def test_sigkill_decode_worker_mid_stream_every_stream_completes_unchanged() -> None:
    prompts = [f"request {i}: tell me something long" for i in range(32)]
    async with serving_tree(
        mode="aggregated",
        decode_workers=2,
        router="round_robin",
        engine_args={"timing": {"speedup": 1.0}},
    ) as tree:

        async def run(client: httpx.AsyncClient, i: int, into: dict[int, dict[str, Any]]) -> None:
            # Half with logprobs: a migration continues them with no gap and no repeat.
            logprobs = 2 if i % 2 else None
            into[i] = await _stream_text(client, prompts[i], 120, logprobs=logprobs)

        # A fresh client per phase: no keep-alive connection is reused across them.
        baseline: dict[int, dict[str, Any]] = {}
        async with httpx.AsyncClient(base_url=tree.url) as client, anyio.create_task_group() as tg:
            for i in range(32):
                tg.start_soon(run, client, i, baseline)
        victim = await tree.engine_stats("decode-0")
        faulted: dict[int, dict[str, Any]] = {}
        async with httpx.AsyncClient(base_url=tree.url) as client, anyio.create_task_group() as tg:
            for i in range(32):
                tg.start_soon(run, client, i, faulted)
            with anyio.fail_after(30):
                while (await tree.engine_stats("decode-0")).running < 4:
                    await anyio.sleep(0.01)
            os.kill(victim.pid, signal.SIGKILL)
    assert all(r["error"] is None for r in faulted.values()), [
        r["error"] for r in faulted.values() if r["error"]
    ]
    for i in range(32):
        assert faulted[i]["text"] == baseline[i]["text"], i
        assert faulted[i]["finish"] == "length"
        assert faulted[i]["usage"]["completion_tokens"] == 120
        assert faulted[i]["logprobs"] == baseline[i]["logprobs"], i
        assert len(faulted[i]["logprobs"].get("tokens", ())) == (120 if i % 2 else 0)


async def test_migration_limit_zero_reports_a_typed_error() -> None:
    async with (
        serving_tree(
            mode="aggregated",
            decode_workers=2,
            migration_limit=0,
            engine_args={"timing": {"speedup": 2.0}},
        ) as tree,
        httpx.AsyncClient(base_url=tree.url) as client,
    ):
        results: list[dict[str, Any]] = []

        async def run(i: int) -> None:
            results.append(await _stream_text(client, f"prompt {i}", 200))

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(run, i)
            with anyio.fail_after(30):
                while (await tree.engine_stats("decode-0")).running < 1:
                    await anyio.sleep(0.01)
            os.kill((await tree.engine_stats("decode-0")).pid, signal.SIGKILL)
    errors = [r for r in results if r["error"] is not None]
    assert errors, "a request on the killed worker must fail when migration is off"
    for failed in errors:
        assert failed["error"]["code"] == "request.migration_exhausted"
        assert "engine_failure" in failed["error"]["message"]
        assert failed["status"] in (200, 500)  # an SSE error event, or the status before any output


async def test_kv_aware_routing_sends_a_repeated_prefix_to_its_holder() -> None:
    async with serving_tree(mode="aggregated", decode_workers=2, router="kv_aware") as tree:
        async with httpx.AsyncClient(base_url=tree.url) as client:
            for round_ in range(3):
                prefix = f"shared context number {round_} " * 12
                first = await _stream_text(client, prefix, 4)
                assert first["error"] is None
                tokens = tree.serving.model().tokenizer.encode(prefix)
                with anyio.fail_after(10):
                    while (
                        max(
                            tree.serving.model().table.overlap(w, tokens)
                            for w in tree.serving.model().table.workers
                        )
                        < 5
                    ):
                        await anyio.sleep(0.02)
                second = await _stream_text(client, prefix + "and a question", 4)
                assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.parametrize("phase", ["queued", "prefill", "decode"])
async def test_client_disconnect_aborts_in_every_phase(phase: str) -> None:
    engine_args: dict[str, Any] = {"max_running_requests": 1, "timing": {"speedup": 1.0}}
    async with serving_tree(mode="aggregated", decode_workers=1, engine_args=engine_args) as tree:
        async with httpx.AsyncClient(base_url=tree.url) as client:
            async with anyio.create_task_group() as tg:
                if phase == "queued":
                    tg.start_soon(_stream_text, client, "keeps the only slot busy", 60)
                    with anyio.fail_after(10):
                        while (await tree.engine_stats("decode-0")).running < 1:
                            await anyio.sleep(0.01)
                prompt = "x" * 3000 if phase == "prefill" else "short"
                body = json.dumps(
                    {"model": "mock", "prompt": prompt, "max_tokens": 500, "stream": True}
                )
                started = time.monotonic()
                # A raw socket, so the disconnect is exactly a closed connection.
                async with await anyio.connect_tcp("127.0.0.1", tree.serving.port or 0) as sock:
                    await sock.send(
                        (
                            "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                            "Content-Type: application/json\r\n"
                            f"Content-Length: {len(body)}\r\n\r\n{body}"
                        ).encode()
                    )
                    if phase == "decode":
                        with anyio.fail_after(10):
                            while (await tree.engine_stats("decode-0")).last_output <= started:
                                await anyio.sleep(0.005)
                    else:
                        await anyio.sleep(0.05)
                # leaving the block closed the connection mid-request
        with anyio.fail_after(10):
            while True:
                stats = await tree.engine_stats("decode-0")
                if stats.engine_in_flight == 0 and stats.kv_used_blocks == 0:
                    break
                await anyio.sleep(0.02)


async def test_bad_inputs_get_4xx_and_the_server_keeps_serving() -> None:
    async with serving_tree(mode="aggregated", decode_workers=1) as tree:
        async with httpx.AsyncClient(base_url=tree.url) as client:
            cases = [
                (b"{not json", 400),
                (json.dumps({"model": "mock", "prompt": 5, "max_tokens": "many"}).encode(), 400),
                (json.dumps({"model": "mock", "prompt": "hi", "max_tokens": -3}).encode(), 400),
                (json.dumps({"model": "nope", "prompt": "hi", "max_tokens": 3}).encode(), 404),
                (
                    json.dumps({"model": "mock", "prompt": "y" * 5000, "max_tokens": 3}).encode(),
                    400,
                ),
            ]
            for body, status in cases:
                response = await client.post(
                    "/v1/completions", content=body, headers={"content-type": "application/json"}
                )
                assert response.status_code == status, (body[:40], response.text)
                assert "error" in response.json()
            ok = await _stream_text(client, "still serving", 5)
            assert ok["finish"] == "length" and ok["error"] is None
