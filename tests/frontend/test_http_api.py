"""The OpenAI-compatible API over a real HTTP server on 127.0.0.1: shapes, streaming,
usage, stop strings, request mapping, the openai client, models, health and metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx
import openai
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from actors.serving.frontend import ByteTokenizer, HFTokenizer, create_app
from actors.serving.frontend._streams import aclose_quietly
from actors.serving.testing import ANSWER, CONTEXT, MODEL, FakeBackend
from protocols.engine import EngineOutput, Grammar, PreprocessedRequest
from protocols.errors import NoWorkerAvailable
from tests.frontend._hf import build_tokenizer_folder
from tests.frontend._http import CHAT, COMPLETIONS, chat_body, chunks
from tests.frontend.conftest import served
from tests.helpers.openai_streams import OPENAI_STREAMS

PROMPT_IDS = ByteTokenizer().apply_chat_template([{"role": "user", "content": "hi"}])
BEFORE_STOP = ANSWER[: ANSWER.index("STOP")]


async def test_chat_completion(base_url: str, backend: FakeBackend) -> None:
    async with httpx.AsyncClient(base_url=base_url) as client:
        r = await client.post(CHAT, json=chat_body())
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert isinstance(body["created"], int)
    assert body["model"] == MODEL
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": ANSWER},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    n_answer = len(ANSWER.encode())
    assert body["usage"] == {
        "prompt_tokens": len(PROMPT_IDS),
        "completion_tokens": n_answer,
        "total_tokens": len(PROMPT_IDS) + n_answer,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    [request] = backend.requests
    assert request.rid == body["id"]
    assert request.token_ids == PROMPT_IDS
    assert request.eos_token_ids == [ByteTokenizer.EOS]
    # No max_tokens: the rest of the context.
    assert request.stop_conditions.max_tokens == CONTEXT - len(PROMPT_IDS)
    assert backend.completed == [request.rid]


async def test_chat_stream_with_usage(base_url: str) -> None:
    body = chat_body(stream=True, stream_options={"include_usage": True})
    async with httpx.AsyncClient(base_url=base_url) as client:
        r = await client.post(CHAT, json=body)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = chunks(r.text)
    ids = {c["id"] for c in events}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in events[:-1])
    assert content == ANSWER
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in events[:-2])
    assert all(c["usage"] is None for c in events[:-1])
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] == len(ANSWER.encode())


async def test_stream_without_usage_has_no_usage_key(base_url: str) -> None:
    async with httpx.AsyncClient(base_url=base_url) as client:
        r = await client.post(CHAT, json=chat_body(stream=True))
    events = chunks(r.text)
    assert all("usage" not in c for c in events)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


async def test_keep_alive_pings_come_after_the_status_line(backend: FakeBackend) -> None:
    backend.delay = 0.05  # quiet stretches, the wait for the first output included
    backend.chunk = 24
    app = create_app(backend, CollectorRegistry(), ping_interval_s=0.01)
    async with served(app) as url, httpx.AsyncClient(base_url=url) as client:
        r = await client.post(CHAT, json=chat_body(stream=True))
    assert r.status_code == 200
    assert ": ping" in r.text
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks(r.text))
    assert content == ANSWER


async def test_keep_alive_pings_end_with_an_error_before_the_first_output(
    backend: FakeBackend,
) -> None:
    backend.error_before = NoWorkerAvailable("none yet")
    app = create_app(backend, CollectorRegistry(), ping_interval_s=0.01)
    async with served(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as client:
        r = await client.post(CHAT, json=chat_body(stream=True))
        assert r.status_code == 503  # the error keeps its status; no ping waits forever
        backend.error_before = None
        assert (await client.post(CHAT, json=chat_body(stream=True))).status_code == 200


class _ReadyOutputs:
    """Outputs that are all there at once, handed out by ``next_nowait`` too."""

    def __init__(self, outputs: AsyncIterator[EngineOutput]) -> None:
        self.outputs = outputs
        self.ready: list[EngineOutput] = []
        self.polled = 0

    def __aiter__(self) -> _ReadyOutputs:
        return self

    async def __anext__(self) -> EngineOutput:
        if not self.ready:
            self.ready = [out async for out in self.outputs]
        if not self.ready:
            raise StopAsyncIteration
        return self.ready.pop(0)

    def next_nowait(self) -> EngineOutput | None:
        self.polled += 1
        return self.ready.pop(0) if self.ready else None

    async def aclose(self) -> None:
        await aclose_quietly(self.outputs)


async def test_outputs_already_there_go_out_together(backend: FakeBackend) -> None:
    streams: list[_ReadyOutputs] = []
    generate = backend.generate

    def ready_generate(model: str, request: PreprocessedRequest) -> AsyncIterator[EngineOutput]:
        streams.append(_ReadyOutputs(generate(model, request)))
        return streams[-1]

    backend.generate = ready_generate  # type: ignore[method-assign]
    app = create_app(backend, CollectorRegistry())
    body = chat_body(stream=True, stream_options={"include_usage": True})
    async with served(app) as url, httpx.AsyncClient(base_url=url) as client:
        r = await client.post(CHAT, json=body)
    events = chunks(r.text)
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in events[:-1])
    assert content == ANSWER
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["usage"]["completion_tokens"] == len(ANSWER.encode())
    # Every output after the first was taken without waiting: one frame per output all the same.
    assert streams[0].polled >= len(events) - 3


async def test_completion_with_max_tokens(base_url: str, backend: FakeBackend) -> None:
    prompt = "Say something"
    async with httpx.AsyncClient(base_url=base_url) as client:
        r = await client.post(
            COMPLETIONS, json={"model": MODEL, "prompt": prompt, "max_tokens": 10}
        )
    body = r.json()
    assert r.status_code == 200
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    [choice] = body["choices"]
    assert choice["text"] == ANSWER.encode()[:10].decode()
    assert choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(prompt) + 1  # bytes + BOS
    assert body["usage"]["completion_tokens"] == 10
    assert backend.requests[0].stop_conditions.max_tokens == 10


async def test_completion_default_max_tokens_is_16(base_url: str, backend: FakeBackend) -> None:
    async with httpx.AsyncClient(base_url=base_url) as client:
        r = await client.post(COMPLETIONS, json={"model": MODEL, "prompt": [72, 105]})
    assert r.status_code == 200
    assert backend.requests[0].token_ids == [72, 105]
    assert backend.requests[0].stop_conditions.max_tokens == 16


async def test_completion_stream_with_echo(base_url: str) -> None:
    body = {
        "model": MODEL,
        "prompt": ["Echo me:"],
        "echo": True,
        "stream": True,
        "max_tokens": 200,
        "stream_options": {"include_usage": True},
    }
    async with httpx.AsyncClient(base_url=base_url) as client:
        r = await client.post(COMPLETIONS, json=body)
    events = chunks(r.text)
    assert all(c["object"] == "text_completion" for c in events)
    text = "".join(c["choices"][0]["text"] for c in events[:-1])
    assert text == "Echo me:" + ANSWER
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["usage"]["prompt_tokens"] == len("Echo me:") + 1


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string_truncates_and_aborts(
    base_url: str, backend: FakeBackend, stream: bool
) -> None:
    async with httpx.AsyncClient(base_url=base_url) as client:
        r = await client.post(CHAT, json=chat_body(stop=["STOP", "never"], stream=stream))
    if stream:
        events = chunks(r.text)
        content = "".join(c["choices"][0]["delta"].get("content", "") for c in events)
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
    else:
        content = r.json()["choices"][0]["message"]["content"]
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        assert r.json()["usage"]["completion_tokens"] < len(ANSWER.encode())
    assert content == BEFORE_STOP
    assert backend.requests[0].stop_conditions.stop == ["STOP", "never"]
    # The engine request was closed early (the stop string ended it).
    assert backend.cancelled == [backend.requests[0].rid]


async def test_request_fields_reach_the_engine(base_url: str, backend: FakeBackend) -> None:
    body = chat_body(
        max_completion_tokens=50,
        max_tokens=99,
        min_tokens=3,
        stop="x",
        stop_token_ids=[7],
        ignore_eos=True,
        temperature=0.5,
        top_p=0.9,
        top_k=20,
        min_p=0.1,
        seed=1234,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {}}},
        user="someone",
        unknown_field={"is": "ignored"},
    )
    async with httpx.AsyncClient(base_url=base_url) as client:
        r = await client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    [req] = backend.requests
    stop, sampling = req.stop_conditions, req.sampling_options
    assert (stop.max_tokens, stop.min_tokens, stop.stop) == (50, 3, ["x"])
    assert (stop.stop_token_ids, stop.ignore_eos) == ([7], True)
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.5, 0.9, 20)
    assert (sampling.min_p, sampling.seed) == (0.1, 1234)
    assert sampling.presence_penalty == 0.5 and sampling.frequency_penalty == -0.5
    assert sampling.repetition_penalty == 1.1
    assert sampling.guided_decoding == Grammar(kind="json_schema", spec="{}")
    assert req.model == MODEL


@OPENAI_STREAMS
async def test_openai_async_client(base_url: str) -> None:
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0) as c:
        chat = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=128
        )
        assert chat.choices[0].message.content == ANSWER
        assert chat.usage is not None and chat.usage.completion_tokens == len(ANSWER.encode())
        stream = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
            stop=["STOP"],
        )
        parts: list[str] = []
        usage = None
        async for chunk in stream:
            parts.extend(ch.delta.content or "" for ch in chunk.choices)
            usage = chunk.usage or usage
        assert "".join(parts) == BEFORE_STOP
        assert usage is not None
        models = await c.models.list()
        assert [m.id for m in models.data] == [MODEL]


def _sync_client_session(base_url: str) -> tuple[str, str]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0) as client:
        completion = client.completions.create(model=MODEL, prompt="hello", max_tokens=5)
        streamed = "".join(
            chunk.choices[0].text
            for chunk in client.completions.create(
                model=MODEL, prompt="hello", max_tokens=5, stream=True
            )
            if chunk.choices
        )
    return completion.choices[0].text, streamed


async def test_openai_sync_client_in_a_thread(base_url: str) -> None:
    text, streamed = await anyio.to_thread.run_sync(_sync_client_session, base_url)
    assert text == streamed == ANSWER.encode()[:5].decode(errors="ignore")


async def test_hf_tokenizer_end_to_end(tmp_path: Path) -> None:
    tokenizer = HFTokenizer.from_pretrained(build_tokenizer_folder(tmp_path))
    backend = FakeBackend(tokenizer)
    backend.chunk = 1  # one token per output: multi-byte characters span outputs
    app = create_app(backend, CollectorRegistry())
    async with served(app) as url, httpx.AsyncClient(base_url=url) as client:
        r = await client.post(CHAT, json=chat_body(stream=True))
    events = chunks(r.text)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in events) == ANSWER
    assert backend.requests[0].eos_token_ids == tokenizer.eos_token_ids
    assert backend.requests[0].token_ids == tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}]
    )


async def test_models(base_url: str) -> None:
    async with httpx.AsyncClient(base_url=base_url) as client:
        listed = (await client.get("/v1/models")).json()
        one = await client.get(f"/v1/models/{MODEL}")
        missing = await client.get("/v1/models/nope")
    assert listed["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in listed["data"]] == [
        (MODEL, "model", CONTEXT)
    ]
    assert one.json()["id"] == MODEL
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


async def test_openapi_documents_the_generation_routes(base_url: str) -> None:
    async with httpx.AsyncClient(base_url=base_url) as client:
        schema = (await client.get("/openapi.json")).json()
    for path, model in ((CHAT, "ChatCompletionRequest"), (COMPLETIONS, "CompletionRequest")):
        post = schema["paths"][path]["post"]
        body = post["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert {"200", "400", "404", "503"} <= set(post["responses"])
        assert "text/event-stream" in post["responses"]["200"]["content"]
    assert "ChatMessage" in schema["components"]["schemas"]


async def test_a_mounted_app_serves_the_same_api(backend: FakeBackend) -> None:
    outer = FastAPI()
    outer.mount("/api", create_app(backend, CollectorRegistry()))
    async with served(outer) as url, httpx.AsyncClient(base_url=f"{url}/api") as client:
        streamed = await client.post(CHAT, json=chat_body(stream=True))
        unary = await client.post(COMPLETIONS, json={"model": MODEL, "prompt": "hi"})
        invalid = await client.post(CHAT, json={"model": MODEL})
        wrong = await client.get(CHAT)
        models = await client.get("/v1/models")
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks(streamed.text))
    assert content == ANSWER
    assert unary.status_code == 200 and unary.json()["object"] == "text_completion"
    assert invalid.status_code == 400 and invalid.json()["error"]["param"] == "messages"
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert models.json()["data"][0]["id"] == MODEL


async def test_health_and_live(base_url: str, backend: FakeBackend) -> None:
    async with httpx.AsyncClient(base_url=base_url) as client:
        ready = await client.get("/health")
        backend.ready = False
        notready = await client.get("/health")
        live = await client.get("/live")
    assert ready.status_code == 200
    assert ready.json()["status"] == "ready"
    assert ready.json()["models"][MODEL] == {
        "status": "ready",
        "reason": None,
        "workers": {
            "prefill-0": {"role": "prefill", "state": "ready"},
            "decode-0": {"role": "decode", "state": "ready"},
        },
    }
    assert notready.status_code == 503
    assert notready.json()["status"] == "notready"
    model = notready.json()["models"][MODEL]
    assert model["reason"] == "no routable decode worker"
    assert model["workers"]["decode-0"]["state"] == "restarting"
    assert live.status_code == 200 and live.json()["status"] == "live"


async def test_metrics(base_url: str, registry: CollectorRegistry) -> None:
    async with httpx.AsyncClient(base_url=base_url) as client:
        await client.post(CHAT, json=chat_body(stream=True))
        await client.post(CHAT, json=chat_body())
        await client.post(CHAT, json={"model": MODEL})  # invalid: no messages
        r = await client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in (
        "actorserve_frontend_requests_total",
        "actorserve_frontend_active_requests",
        "actorserve_frontend_time_to_first_token_seconds_bucket",
        "actorserve_frontend_inter_token_latency_seconds_bucket",
        "actorserve_frontend_request_duration_seconds_bucket",
        "actorserve_frontend_output_tokens_total",
        "fake_backend_calls_total",  # the backend's own registry
    ):
        assert name in text, name

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    ok = {"model": MODEL, "endpoint": CHAT, "status": "success", "error_type": ""}
    assert value("actorserve_frontend_requests_total", request_type="stream", **ok) == 1
    assert value("actorserve_frontend_requests_total", request_type="unary", **ok) == 1
    bad = {"model": "", "endpoint": CHAT, "request_type": "", "status": "error"}
    assert value("actorserve_frontend_requests_total", error_type="validation", **bad) == 1
    assert value("actorserve_frontend_output_tokens_total", model=MODEL) == 2 * len(ANSWER.encode())
    assert value("actorserve_frontend_active_requests", model=MODEL) == 0
    assert value("actorserve_frontend_time_to_first_token_seconds_count", model=MODEL) == 2
