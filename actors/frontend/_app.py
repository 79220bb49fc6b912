"""The OpenAI-compatible ASGI app: routes, request mapping, streaming, disconnect handling."""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException
from starlette.responses import Response

from protocols.engine import EngineOutput, PreprocessedRequest, SamplingOptions, StopConditions
from protocols.errors import ContextLengthExceeded, ModelNotFound, Overloaded, RequestError

from ._backend import Backend, ModelInfo
from ._chunks import DONE_FRAME, ChatRenderer, CompletionRenderer, Renderer, error_frame
from ._errors import (
    error_body,
    error_response,
    error_type_label,
    http_exception_response,
    internal_error_handler,
    invalid,
    validation_error_response,
)
from ._metrics import FrontendMetrics, RequestMetrics
from ._openai_types import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    ResponseFormat,
)
from ._pipeline import Choice
from ._sse import SSEResponse
from ._streams import aclose_quietly, next_output, until_disconnected

__all__ = ["create_app"]

log = logging.getLogger("actorserve.frontend")

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
#: Prompts longer than this (in characters) are tokenised in a worker thread, so one huge prompt
#: cannot stall every other stream on the event loop; short ones stay inline (a thread hop costs
#: more than tokenising them).
_THREAD_TOKENIZE_CHARS = 32_768

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 404, 499, 500, 503)
}


#: One event of a completion stream: ``data`` is a JSON chunk, an error object (``event: error``)
#: or ``[DONE]``.
_SSE_EVENT = {
    "type": "object",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    "required": ["data"],
}


def _responses(model: type[Any]) -> dict[int | str, dict[str, Any]]:
    return {
        200: {
            "model": model,
            "content": {"text/event-stream": {"schema": _SSE_EVENT}},
            "description": "The completion; a stream of SSE events when `stream` is true.",
        },
        **_ERRORS,
    }


def create_app(
    backend: Backend,
    registry: CollectorRegistry,
    *,
    max_inflight: int | None = None,
    retry_after_s: int = 1,
    ping_interval_s: float = 15.0,
) -> FastAPI:
    """The frontend's ASGI app for ``backend``.

    Frontend metrics are registered on ``registry``, which ``/metrics`` exposes (with the
    backend's own registry, if it has one). ``max_inflight`` caps concurrent generation requests
    (beyond it: 503 with ``Retry-After: retry_after_s``); ``ping_interval_s`` is the SSE keep-alive
    comment interval.
    """
    frontend = _Frontend(backend, registry, max_inflight, retry_after_s, ping_interval_s)
    app = FastAPI(title="actorserve", version="0.1.0", description="OpenAI-compatible API")
    app.add_api_route(
        CHAT_PATH,
        frontend.chat_completions,
        methods=["POST"],
        response_class=Response,
        responses=_responses(ChatCompletionResponse),
    )
    app.add_api_route(
        COMPLETIONS_PATH,
        frontend.completions,
        methods=["POST"],
        response_class=Response,
        responses=_responses(CompletionResponse),
    )
    app.add_api_route("/v1/models", frontend.list_models, methods=["GET"], response_model=ModelList)
    app.add_api_route(
        "/v1/models/{model_id:path}",
        frontend.get_model,
        methods=["GET"],
        response_model=ModelCard,
        responses={404: {"model": ErrorResponse}},
    )
    app.add_api_route("/health", frontend.health, methods=["GET"], response_class=Response)
    app.add_api_route("/live", frontend.live, methods=["GET"], response_class=Response)
    app.add_api_route("/metrics", frontend.metrics_text, methods=["GET"], response_class=Response)
    app.add_exception_handler(RequestValidationError, frontend.on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _on_http_exception)  # type: ignore[arg-type]
    app.add_exception_handler(RequestError, frontend.on_request_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, internal_error_handler)
    return app


async def _on_http_exception(request: Request, exc: HTTPException) -> Response:
    return http_exception_response(exc)


def _json(obj: object, status: int = 200) -> Response:
    return Response(json.dumps(obj).encode(), status_code=status, media_type="application/json")


def _guided(fmt: ResponseFormat | None) -> dict[str, object] | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object" or fmt.json_schema is None or fmt.json_schema.schema_ is None:
        return {"json": {"type": "object"}}
    return {"json": fmt.json_schema.schema_}


class _Frontend:
    def __init__(
        self,
        backend: Backend,
        registry: CollectorRegistry,
        max_inflight: int | None,
        retry_after_s: int,
        ping_interval_s: float,
    ) -> None:
        self.backend = backend
        self.registry = registry
        self.metrics = FrontendMetrics.on(registry)
        self.max_inflight = max_inflight
        self.retry_after_s = retry_after_s
        self.ping_interval_s = ping_interval_s
        self.inflight = 0
        self.started = time.monotonic()

    # --- generation endpoints ---------------------------------------------------------------

    async def chat_completions(self, request: Request, body: ChatCompletionRequest) -> Response:
        """Create a chat completion (OpenAI ``POST /v1/chat/completions``)."""
        m = self.metrics.start(CHAT_PATH)
        try:
            info = self._admit(body.model, body.n)
            if body.logprobs or body.top_logprobs:
                raise invalid("logprobs are not supported", "logprobs")
            messages = [_message(msg.role, msg.text(), msg.name) for msg in body.messages]
            size = sum(len(msg["content"]) for msg in messages)
            prompt = await _tokenize(lambda: info.tokenizer.apply_chat_template(messages), size)
            rid = f"chatcmpl-{secrets.token_hex(16)}"
            max_tokens = body.max_completion_tokens or body.max_tokens
            preq = _preprocessed(
                rid, prompt, info, body, max_tokens, "messages", _guided(body.response_format)
            )
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            renderer = ChatRenderer(rid, info.name, int(time.time()), include_usage=include_usage)
            return await self._generate(request, info, preq, renderer, body, m, "")
        except RequestError as exc:
            return self._fail(m, exc)
        except Exception as exc:
            return self._internal(m, exc)

    async def completions(self, request: Request, body: CompletionRequest) -> Response:
        """Create a text completion (OpenAI ``POST /v1/completions``)."""
        m = self.metrics.start(COMPLETIONS_PATH)
        try:
            info = self._admit(body.model, body.n)
            if body.best_of is not None and body.best_of > 1:
                raise invalid("best_of > 1 is not supported", "best_of")
            if body.logprobs is not None:
                raise invalid("logprobs are not supported", "logprobs")
            if body.suffix:
                raise invalid("suffix is not supported", "suffix")
            prompt_text, prompt = await self._prompt(info, body.prompt)
            rid = f"cmpl-{secrets.token_hex(16)}"
            # OpenAI's default for completions is 16 tokens (chat's is "the rest of the context").
            max_tokens = 16 if body.max_tokens is None else body.max_tokens
            preq = _preprocessed(rid, prompt, info, body, max_tokens, "prompt", None)
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            renderer = CompletionRenderer(
                rid, info.name, int(time.time()), include_usage=include_usage
            )
            echo = "" if not body.echo else prompt_text or info.tokenizer.decode(prompt)
            return await self._generate(request, info, preq, renderer, body, m, echo)
        except RequestError as exc:
            return self._fail(m, exc)
        except Exception as exc:
            return self._internal(m, exc)

    async def _prompt(
        self, info: ModelInfo, prompt: str | list[int] | list[str] | list[list[int]]
    ) -> tuple[str | None, list[int]]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise invalid("batched prompts are not supported: send one prompt", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            text = prompt
            return text, await _tokenize(lambda: info.tokenizer.encode(text), len(text))
        return None, [int(t) for t in prompt]  # type: ignore[arg-type]

    def _admit(self, model: str, n: int) -> ModelInfo:
        info = next((i for i in self.backend.models() if i.name == model), None)
        if info is None:
            exc = ModelNotFound(f"The model `{model}` does not exist.")
            setattr(exc, "param", "model")  # noqa: B010
            raise exc
        if n != 1:
            raise invalid("n > 1 is not supported", "n")
        if self.max_inflight is not None and self.inflight >= self.max_inflight:
            raise Overloaded(f"too many requests in flight (limit {self.max_inflight})")
        return info

    async def _generate(
        self,
        request: Request,
        info: ModelInfo,
        preq: PreprocessedRequest,
        renderer: Renderer,
        body: ChatCompletionRequest | CompletionRequest,
        m: RequestMetrics,
        echo: str,
    ) -> Response:
        stop = preq.stop_conditions.stop or ()
        choice = Choice(
            info.tokenizer.detokenizer(preq.token_ids),
            prompt_tokens=len(preq.token_ids),
            stop=stop,
            min_tokens=preq.stop_conditions.min_tokens or 0,
        )
        m.admitted(info.name, "stream" if body.stream else "unary", len(preq.token_ids))
        self.inflight += 1
        outputs = self.backend.generate(info.name, preq)
        if body.stream:
            return await self._stream(request, outputs, choice, renderer, m, echo)
        return await self._unary(request, outputs, choice, renderer, m, echo)

    async def _unary(
        self,
        request: Request,
        outputs: AsyncIterator[EngineOutput],
        choice: Choice,
        renderer: Renderer,
        m: RequestMetrics,
        echo: str,
    ) -> Response:
        async def collect() -> tuple[str, str]:
            parts = [echo]
            while True:
                out = await next_output(outputs)
                text, finish = choice.on_output(out)
                m.tokens(len(out.token_ids))
                parts.append(text)
                if finish is not None:
                    return "".join(parts), finish

        try:
            result, disconnected = await until_disconnected(request.receive, collect)
        finally:
            await aclose_quietly(outputs)
        if result is None or disconnected:
            self._finish(m, "cancelled", disconnected=True)
            return Response(status_code=499)
        text, finish = result
        self._finish(m, "success")
        return Response(
            renderer.body(text, finish, choice.final_usage()), media_type="application/json"
        )

    async def _stream(
        self,
        request: Request,
        outputs: AsyncIterator[EngineOutput],
        choice: Choice,
        renderer: Renderer,
        m: RequestMetrics,
        echo: str,
    ) -> Response:
        # Wait for the first output before sending headers, so an error raised before it gets its
        # own HTTP status rather than an error event in a 200 stream. The client may leave
        # meanwhile (a long queue or prefill): that cancels the wait and the request.
        try:
            first, disconnected = await until_disconnected(
                request.receive, lambda: next_output(outputs)
            )
            if first is None or disconnected:
                await aclose_quietly(outputs)
                self._finish(m, "cancelled", disconnected=True)
                return Response(status_code=499)
            text, finish = choice.on_output(first)
            m.tokens(len(first.token_ids))
        except BaseException:
            await aclose_quietly(outputs)
            raise
        gone = anyio.Event()

        async def on_disconnect(message: Mapping[str, Any]) -> None:
            gone.set()

        events = self._events(outputs, echo + text, finish, choice, renderer, m, gone)
        return SSEResponse(
            events,
            ping=self.ping_interval_s,
            sep="\n",
            client_close_handler_callable=on_disconnect,
        )

    async def _events(
        self,
        outputs: AsyncIterator[EngineOutput],
        text: str,
        finish: str | None,
        choice: Choice,
        renderer: Renderer,
        m: RequestMetrics,
        gone: anyio.Event,
    ) -> AsyncIterator[bytes]:
        status, error_type = "cancelled", ""
        try:
            start = renderer.start()
            if start is not None:
                yield start
            if text or finish is not None:
                yield renderer.delta(text, finish)
            if finish is None:
                async for out in outputs:
                    text, finish = choice.on_output(out)
                    m.tokens(len(out.token_ids))
                    if text or finish is not None:
                        yield renderer.delta(text, finish)
                    if finish is not None:
                        break
                else:
                    await next_output(outputs)  # raises StreamIncomplete: it ended too early
            status = "success"
            if renderer.include_usage:
                yield renderer.usage(choice.final_usage())
            yield DONE_FRAME
        except RequestError as exc:
            status, error_type = "error", error_type_label(exc)
            # After the headers, the status line is gone: the error goes in the stream, and the
            # stream still ends properly.
            yield error_frame(error_body(exc.http_status, exc.message, exc.code))
            yield DONE_FRAME
        except Exception as exc:
            status, error_type = "error", "internal"
            log.error("stream failed", exc_info=exc)
            yield error_frame(error_body(500, "internal server error", "internal"))
            yield DONE_FRAME
        finally:
            await aclose_quietly(outputs)
            self._finish(m, status, error_type, disconnected=gone.is_set())

    # --- outcomes ---------------------------------------------------------------------------

    def _finish(
        self, m: RequestMetrics, status: str, error_type: str = "", *, disconnected: bool = False
    ) -> None:
        if m.done(status, error_type, disconnected=disconnected):
            self.inflight -= 1

    def _fail(self, m: RequestMetrics, exc: RequestError) -> Response:
        self._finish(m, "error", error_type_label(exc))
        return error_response(exc, retry_after_s=self.retry_after_s)

    def _internal(self, m: RequestMetrics, exc: Exception) -> Response:
        log.error("request failed", exc_info=exc)
        self._finish(m, "error", "internal")
        return Response(
            error_body(500, "internal server error", "internal"),
            status_code=500,
            media_type="application/json",
        )

    async def on_validation_error(self, request: Request, exc: RequestValidationError) -> Response:
        path = request.url.path
        endpoint = path if path in (CHAT_PATH, COMPLETIONS_PATH) else "other"
        self.metrics.start(endpoint).done("error", "validation")
        return validation_error_response(exc)

    async def on_request_error(self, request: Request, exc: RequestError) -> Response:
        return error_response(exc, retry_after_s=self.retry_after_s)

    # --- models, health, metrics ------------------------------------------------------------

    def _card(self, info: ModelInfo) -> dict[str, object]:
        return {
            "id": info.name,
            "object": "model",
            "created": info.created,
            "owned_by": info.owned_by,
            "max_model_len": info.context_length,
        }

    async def list_models(self) -> Response:
        """The served models (OpenAI ``GET /v1/models``)."""
        cards = [self._card(i) for i in self.backend.models()]
        return _json({"object": "list", "data": cards})

    async def get_model(self, model_id: str) -> Response:
        """One served model (OpenAI ``GET /v1/models/{model}``)."""
        for info in self.backend.models():
            if info.name == model_id:
                return _json(self._card(info))
        return error_response(ModelNotFound(f"The model `{model_id}` does not exist."))

    async def health(self) -> Response:
        """200 when every backend endpoint is ready, else 503; the per-endpoint view either way."""
        try:
            endpoints = {str(k): str(v) for k, v in self.backend.health().items()}
        except Exception as exc:
            log.error("backend health check failed", exc_info=exc)
            endpoints = {}
        ready = bool(endpoints) and all(v == "ready" for v in endpoints.values())
        body = {
            "status": "ready" if ready else "notready",
            "endpoints": endpoints,
            "uptime": round(time.monotonic() - self.started, 3),
        }
        return _json(body, 200 if ready else 503)

    async def live(self) -> Response:
        """Always 200 while the process serves HTTP."""
        return _json({"status": "live", "uptime": round(time.monotonic() - self.started, 3)})

    async def metrics_text(self) -> Response:
        """Prometheus text exposition of the frontend's (and the backend's) registry."""
        data = generate_latest(self.registry)
        extra = self.backend.metrics_registry()
        if extra is not None and extra is not self.registry:
            data += generate_latest(extra)
        return Response(data, media_type=CONTENT_TYPE_LATEST)


def _message(role: str, content: str, name: str | None) -> dict[str, str]:
    msg = {"role": role, "content": content}
    if name:
        msg["name"] = name
    return msg


async def _tokenize(fn: Callable[[], list[int]], size: int) -> list[int]:
    if size > _THREAD_TOKENIZE_CHARS:
        return await anyio.to_thread.run_sync(fn)
    return fn()


def _preprocessed(
    rid: str,
    prompt: list[int],
    info: ModelInfo,
    body: ChatCompletionRequest | CompletionRequest,
    max_tokens: int | None,
    param: str,
    guided: dict[str, object] | None,
) -> PreprocessedRequest:
    n_prompt, ctx = len(prompt), info.context_length
    if n_prompt == 0:
        raise invalid("the prompt is empty", param)
    if n_prompt >= ctx or (max_tokens is not None and n_prompt + max_tokens > ctx):
        wanted = "" if max_tokens is None else f" plus {max_tokens} in the completion"
        exc = ContextLengthExceeded(
            f"This model's maximum context length is {ctx} tokens. However, you requested "
            f"{n_prompt} tokens in the {param}{wanted}. Please reduce the length of the "
            f"{param} or completion."
        )
        setattr(exc, "param", param)  # noqa: B010
        raise exc
    if max_tokens is None:
        max_tokens = ctx - n_prompt
    if body.min_tokens is not None and body.min_tokens > max_tokens:
        raise invalid(
            f"min_tokens ({body.min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens"
        )
    stop: Sequence[str] | None = [body.stop] if isinstance(body.stop, str) else body.stop
    return PreprocessedRequest(
        rid=rid,
        token_ids=prompt,
        stop_conditions=StopConditions(
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=list(stop) if stop else None,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
        ),
        sampling_options=SamplingOptions(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            seed=body.seed,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            guided_decoding=guided,
        ),
        eos_token_ids=info.tokenizer.eos_token_ids,
        model=info.name,
    )
