"""Several choices per request: ``n`` on both endpoints, batched prompts and ``best_of`` on
completions, ``echo`` with the prompt's logprobs; each choice its own engine request, all of them
at once, streamed with their own index, one failure failing them all."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

import anyio
import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from actors.serving.frontend import ByteTokenizer, ModelInfo, create_app
from actors.serving.testing import ANSWER, MODEL, FakeBackend
from protocols.engine import EngineOutput, Grammar, PreprocessedRequest
from protocols.errors import NoWorkerAvailable, RequestError
from tests.frontend._http import (
    CHAT,
    COMPLETIONS,
    chat_body,
    chunks,
    open_raw_stream,
    read_until,
    sse_events,
)
from tests.frontend.conftest import served
from tests.helpers.openai_streams import OPENAI_STREAMS

PROMPT_IDS = ByteTokenizer().apply_chat_template([{"role": "user", "content": "hi"}])


def _index(request: PreprocessedRequest) -> int:
    return int(request.rid.rpartition("-")[2])


def _numbered(request: PreprocessedRequest) -> str:
    """Each choice's answer names its engine request's index (and prompt's last byte)."""
    return f"choice {_index(request)} of {chr(request.token_ids[-1])}."


async def _post(base_url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base_url) as client:
        return await client.post(path, json=body)


def _streamed(events: list[dict[str, Any]], key: str) -> dict[int, str]:
    """Each choice's text, by index, from a stream's chunks (``key``: ``content`` or ``text``)."""
    texts: dict[int, str] = defaultdict(str)
    for event in events:
        for choice in event["choices"]:
            part = choice["delta"].get("content") if key == "content" else choice["text"]
            texts[choice["index"]] += part or ""
    return dict(texts)


async def test_chat_n_is_one_engine_request_per_choice(base_url: str, backend: FakeBackend) -> None:
    backend.answer_of = _numbered
    r = await _post(base_url, CHAT, chat_body(n=3, seed=7, max_tokens=40))
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == [
        f"choice {i} of \n." for i in range(3)
    ]
    assert sorted(req.rid for req in backend.requests) == [f"{body['id']}-{i}" for i in range(3)]
    assert all(req.token_ids == PROMPT_IDS for req in backend.requests)
    # Seeds of their own, derived from the request's: the same again on a rerun.
    seeds = {_index(req): req.sampling_options.seed for req in backend.requests}
    assert seeds[0] == 7 and len(set(seeds.values())) == 3
    again = await _post(base_url, CHAT, chat_body(n=3, seed=7, max_tokens=40))
    assert {_index(req): req.sampling_options.seed for req in backend.requests[3:]} == seeds
    assert [c["message"] for c in again.json()["choices"]] == [
        c["message"] for c in body["choices"]
    ]
    # The prompt counted once, every choice's completion.
    completion = sum(len(c["message"]["content"]) for c in body["choices"])
    assert body["usage"]["prompt_tokens"] == len(PROMPT_IDS)
    assert body["usage"]["completion_tokens"] == completion


async def test_unseeded_choices_get_seeds_of_their_own(base_url: str, backend: FakeBackend) -> None:
    assert (await _post(base_url, CHAT, chat_body(n=4))).status_code == 200
    assert len({req.sampling_options.seed for req in backend.requests}) == 4
    assert (await _post(base_url, CHAT, chat_body())).status_code == 200
    assert backend.requests[-1].sampling_options.seed is None  # one choice: left to the engine


async def test_chat_n_streamed(base_url: str, backend: FakeBackend) -> None:
    backend.answer_of = _numbered
    body = chat_body(n=2, stream=True, stream_options={"include_usage": True}, logprobs=True)
    r = await _post(base_url, CHAT, body)
    events = chunks(r.text)
    assert len({e["id"] for e in events}) == 1
    usage = events[-1]
    assert usage["choices"] == [] and all(e["usage"] is None for e in events[:-1])
    events = events[:-1]
    assert all(len(e["choices"]) == 1 for e in events)
    for index in (0, 1):
        own = [e["choices"][0] for e in events if e["choices"][0]["index"] == index]
        assert own[0]["delta"] == {"role": "assistant", "content": ""}  # the role first
        assert [c["finish_reason"] for c in own] == [None] * (len(own) - 1) + ["stop"]
        logprobs = [t for c in own if c["logprobs"] for t in c["logprobs"]["content"]]
        assert "".join(t["token"] for t in logprobs) == f"choice {index} of \n."
    assert _streamed(events, "content") == {i: f"choice {i} of \n." for i in (0, 1)}
    assert usage["usage"]["prompt_tokens"] == len(PROMPT_IDS)
    assert usage["usage"]["completion_tokens"] == 2 * len("choice 0 of \n.")


async def test_a_batch_of_prompts_with_n(base_url: str, backend: FakeBackend) -> None:
    backend.answer_of = _numbered
    body = {"model": MODEL, "prompt": ["x", "yy", "z"], "n": 2, "max_tokens": 30}
    r = await _post(base_url, COMPLETIONS, body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    # Index prompt * n + j, as OpenAI's.
    assert [(c["index"], c["text"]) for c in choices] == [
        (i, f"choice {i} of {'xyz'[i // 2]}.") for i in range(6)
    ]
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == 2 + 3 + 2  # each prompt once (with its BOS)
    assert usage["completion_tokens"] == sum(len(c["text"]) for c in choices)
    assert usage["prompt_tokens_details"] == {"cached_tokens": 6}

    streamed = chunks((await _post(base_url, COMPLETIONS, {**body, "stream": True})).text)
    assert _streamed(streamed, "text") == {c["index"]: c["text"] for c in choices}
    finishes = [c for e in streamed for c in e["choices"] if c["finish_reason"]]
    assert sorted(c["index"] for c in finishes) == list(range(6))


async def test_a_batch_of_token_id_prompts_with_echo(base_url: str, backend: FakeBackend) -> None:
    backend.answer = "!"
    body = {"model": MODEL, "prompt": [[72, 105], [79, 107]], "echo": True}
    r = await _post(base_url, COMPLETIONS, body)
    assert [c["text"] for c in r.json()["choices"]] == ["Hi!", "Ok!"]
    assert sorted(req.token_ids for req in backend.requests) == [[72, 105], [79, 107]]


async def test_best_of_returns_the_most_likely(base_url: str, backend: FakeBackend) -> None:
    # The fake's every token has logprob -0.25: the shorter answer is the more likely.
    backend.answer_of = lambda req: "x" * (6 - _index(req))
    body = {"model": MODEL, "prompt": ["a", "b"], "best_of": 3, "n": 2}
    r = await _post(base_url, COMPLETIONS, body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [(c["index"], c["text"], c["logprobs"]) for c in choices] == [
        (0, "xxxx", None),  # of prompt a's: 6, 5 and 4 x
        (1, "xxxxx", None),
        (2, "x", None),  # of prompt b's: 3, 2 and 1 x
        (3, "xx", None),
    ]
    # Ranking needs logprobs: the engine is asked for them, the client gets none.
    assert {req.logprobs for req in backend.requests} == {0}
    assert len(backend.requests) == 6
    assert r.json()["usage"]["completion_tokens"] == 6 + 5 + 4 + 3 + 2 + 1


async def test_best_of_limits(base_url: str) -> None:
    async with httpx.AsyncClient(base_url=base_url) as client:
        below_n = await client.post(
            COMPLETIONS, json={"model": MODEL, "prompt": "a", "n": 3, "best_of": 2}
        )
        streamed = await client.post(
            COMPLETIONS, json={"model": MODEL, "prompt": "a", "best_of": 2, "stream": True}
        )
        one = await client.post(
            COMPLETIONS, json={"model": MODEL, "prompt": "a", "best_of": 1, "stream": True}
        )
    for r in (below_n, streamed):
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "best_of"
    assert one.status_code == 200


async def test_echo_with_logprobs(base_url: str, backend: FakeBackend) -> None:
    body = {"model": MODEL, "prompt": "hé", "echo": True, "logprobs": 1, "max_tokens": 2}
    r = await _post(base_url, COMPLETIONS, body)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert choice["text"] == "héH\ufffd"  # the prompt, then "H" and half of "é"
    assert backend.requests[0].prompt_logprobs == 1
    assert choice["logprobs"] == {
        # BOS, the prompt's bytes, then the completion's.
        "tokens": ["<bos>", "h", "\\xc3", "\\xa9", "H", "\\xc3"],
        "token_logprobs": [None, -0.25, -0.25, -0.25, -0.25, -0.25],
        "top_logprobs": [
            None,
            *({token: -0.25} for token in ["h", "\\xc3", "\\xa9", "H", "\\xc3"]),
        ],
        # The BOS takes no room in the text; the completion's offsets go on from the prompt's.
        "text_offset": [0, 0, 1, 2, 2, 3],
    }
    events = chunks((await _post(base_url, COMPLETIONS, {**body, "stream": True})).text)
    parts = [c["choices"][0]["logprobs"] for c in events if c["choices"][0]["logprobs"]]
    assert {key: [v for p in parts for v in p[key]] for key in parts[0]} == choice["logprobs"]
    assert "".join(c["choices"][0]["text"] for c in events) == choice["text"]


class _FailingChoice(FakeBackend):
    """Fails the engine request of choice 1 before its first output (``before``), or after it,
    once ``others_going`` is set."""

    def __init__(self, *, before: bool) -> None:
        super().__init__()
        self.before = before
        self.others_going = anyio.Event()

    def generate(self, model: str, request: PreprocessedRequest) -> AsyncIterator[EngineOutput]:
        if request.rid.endswith("-1") and self.before:
            raise NoWorkerAvailable("no worker for this one")
        return super().generate(model, request)

    async def _outputs(self, request: PreprocessedRequest) -> AsyncGenerator[EngineOutput, None]:
        failing = request.rid.endswith("-1") and not self.before
        async with aclosing(super()._outputs(request)) as outputs:
            async for out in outputs:
                yield out
                if failing:
                    await self.others_going.wait()
                    raise RequestError("choice 1 broke")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_choice_failing_first_fails_the_request_with_its_status(
    stream: bool,
) -> None:
    backend = _FailingChoice(before=True)
    backend.hang_after = 1  # the other choices would go on
    async with served(create_app(backend, CollectorRegistry())) as url:
        r = await _post(url, CHAT, chat_body(n=3, stream=stream))
    assert r.status_code == 503
    assert r.json()["error"]["message"] == "no worker for this one"
    assert sorted(backend.cancelled) == sorted(
        req.rid for req in backend.requests if not req.rid.endswith("-1")
    )


async def test_a_choice_failing_mid_stream_is_an_error_event() -> None:
    backend = _FailingChoice(before=False)
    backend.delay = 0.01
    body = {"model": MODEL, "prompt": "x", "n": 2}
    async with (
        served(create_app(backend, CollectorRegistry())) as url,
        httpx.AsyncClient(base_url=url) as client,
    ):
        async with client.stream("POST", COMPLETIONS, json={**body, "stream": True}) as r:
            # Choice 1 fails once the stream is under way: its status line was sent.
            backend.others_going.set()
            text = (await r.aread()).decode()
        unary = await client.post(COMPLETIONS, json=body)
    assert r.status_code == 200
    events = sse_events(text)
    assert events[-1] == (None, "[DONE]")
    assert events[-2][0] == "error" and "choice 1 broke" in events[-2][1]
    assert unary.status_code == 500 and "choice 1 broke" in unary.json()["error"]["message"]


async def test_a_client_leaving_cancels_every_choice(base_url: str, backend: FakeBackend) -> None:
    backend.hang_after = 2
    stream = await open_raw_stream(base_url, CHAT, chat_body(n=3, stream=True))
    async with stream:
        await read_until(stream, b"data:")
    with anyio.fail_after(10):
        while len(backend.cancelled) < 3:
            await anyio.sleep(0.01)
    assert sorted(backend.cancelled) == sorted(req.rid for req in backend.requests)


async def test_logit_bias_and_grammars_reach_the_engine(
    base_url: str, backend: FakeBackend
) -> None:
    body = chat_body(logit_bias={"5": -100, "300": 2.5}, regex="[a-z]+")
    assert (await _post(base_url, CHAT, body)).status_code == 200
    ebnf = {"model": MODEL, "prompt": "hi", "ebnf": 'root ::= "a"'}
    assert (await _post(base_url, COMPLETIONS, ebnf)).status_code == 200
    json_format = {"model": MODEL, "prompt": "hi", "response_format": {"type": "json_object"}}
    assert (await _post(base_url, COMPLETIONS, json_format)).status_code == 200
    chat, completion, formatted = (req.sampling_options for req in backend.requests)
    assert chat.logit_bias == {5: -100.0, 300: 2.5}
    assert chat.guided_decoding == Grammar(kind="regex", spec="[a-z]+")
    assert completion.guided_decoding == Grammar(kind="ebnf", spec='root ::= "a"')
    assert formatted.guided_decoding == Grammar(kind="json_object")


class _Vocabulary(FakeBackend):
    def models(self) -> list[ModelInfo]:
        return [ModelInfo(MODEL, 256, self.tokenizer, vocab_size=258)]


async def test_logit_bias_outside_the_vocabulary_is_400() -> None:
    async with served(create_app(_Vocabulary(), CollectorRegistry())) as url:
        ok = await _post(url, CHAT, chat_body(logit_bias={"257": 1}))
        r = await _post(url, CHAT, chat_body(logit_bias={"258": 1}))
    assert ok.status_code == 200
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "logit_bias"
    assert "258" in r.json()["error"]["message"]


@OPENAI_STREAMS
async def test_the_openai_client_reads_several_choices(base_url: str) -> None:
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0) as c:
        chat = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, seed=1
        )
        batch = await c.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=3, n=2)
        texts: dict[int, str] = defaultdict(str)
        stream = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3, stream=True
        )
        async for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
    assert [choice.message.content for choice in chat.choices] == [ANSWER, ANSWER]
    assert [(choice.index, choice.text) for choice in batch.choices] == [
        (i, "Hé") for i in range(4)
    ]
    assert dict(texts) == dict.fromkeys(range(3), ANSWER)
