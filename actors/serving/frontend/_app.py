"""The OpenAI-compatible ASGI app: routes, request mapping, streaming, disconnect handling."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from protocols.engine import EngineOutput, PreprocessedRequest
from protocols.errors import ModelNotFound, Overloaded, RequestError, StreamIncomplete

from ._backend import Backend, ModelInfo
from ._chunks import DONE_FRAME, ChatRenderer, CompletionRenderer, Renderer, error_frame
from ._door import Door, GenerationRoute
from ._errors import (
    error_body,
    error_payload,
    error_response,
    error_type_label,
    http_exception_response,
    internal_error_handler,
    internal_error_response,
)
from ._mapping import build_request, chat_prompt, completion_prompt, guided_decoding
from ._metrics import FrontendMetrics, RequestMetrics
from ._openai_types import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from ._ops import Ops
from ._pipeline import Choice
from ._sse import SSEResponse, SSEWriter
from ._streams import (
    STREAM_ENDED,
    aclose_quietly,
    next_output,
    ready_output,
    until_disconnected,
)

__all__ = ["create_app"]

log = logging.getLogger("actorserve.frontend")

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
#: Request bodies above this are refused (413) before they are read.
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 404, 499, 500, 503)
}

#: Where the published schema keeps its models, for the ``$ref`` of a model's own JSON schema.
_REF_TEMPLATE = "#/components/schemas/{model}"

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
    ping_interval_s: float = 0.0,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The frontend's ASGI app for ``backend``.

    Frontend metrics are registered on ``registry``, which ``/metrics`` exposes (with the
    backend's own registry, if it has one). ``max_inflight`` caps concurrent generation requests
    (beyond it: 503 with ``Retry-After: retry_after_s``); larger bodies than ``max_body_bytes``
    get a 413. ``ping_interval_s > 0`` sends SSE keep-alive comments (``: ping``) during quiet
    stretches of a stream, for proxies that cut idle connections; off by default, like vLLM's and
    SGLang's servers, because the ping task costs about as much CPU per stream as the rest of the
    SSE machinery.
    """
    frontend = _Frontend(backend, registry, max_inflight, retry_after_s, ping_interval_s)
    ops = Ops(backend, registry)
    chat = GenerationRoute(CHAT_PATH, ChatCompletionRequest, frontend.chat_completions)
    completions = GenerationRoute(COMPLETIONS_PATH, CompletionRequest, frontend.completions)
    door = Door([chat, completions], max_body_bytes, frontend.metrics)
    app = _App(
        door,
        [
            _documented(chat, ChatCompletionResponse),
            _documented(completions, CompletionResponse),
        ],
        title="actorserve",
        version="0.1.0",
        description="OpenAI-compatible API",
        # FastAPI's own OpenTelemetry instrumentation: off, as it costs a check and a wrapper on
        # every request; our Prometheus metrics cover the requests.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.router.routes.extend(door.entrances())
    app.add_api_route("/v1/models", ops.list_models, methods=["GET"], response_model=ModelList)
    app.add_api_route(
        "/v1/models/{model_id:path}",
        ops.get_model,
        methods=["GET"],
        response_model=ModelCard,
        responses={404: {"model": ErrorResponse}},
    )
    app.add_api_route(
        "/health",
        ops.health,
        methods=["GET"],
        response_class=Response,
        responses={200: {"description": "Ready"}, 503: {"description": "Not ready"}},
    )
    app.add_api_route("/live", ops.live, methods=["GET"], response_class=Response)
    app.add_api_route("/metrics", ops.metrics, methods=["GET"], response_class=Response)
    app.add_exception_handler(HTTPException, _on_http_exception)  # type: ignore[arg-type]
    app.add_exception_handler(RequestError, frontend.on_request_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, internal_error_handler)
    return app


def _documented(route: GenerationRoute[Any], response_model: type[Any]) -> APIRoute:
    """The OpenAPI entry of a generation route, from its endpoint and body model; a route object
    that no router holds, so no request can reach it."""
    return APIRoute(
        route.path,
        route.endpoint,
        methods=["POST"],
        response_class=Response,
        responses=_responses(response_model),
    )


class _App(FastAPI):
    """FastAPI, with the requests to a generation path handed to the door (see :mod:`._door`)
    before any of FastAPI's layers."""

    def __init__(self, door: Door, documented: list[APIRoute], **settings: Any) -> None:
        super().__init__(**settings)
        self.door = door
        self.documented = documented

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.door.route(scope)
        if route is None:
            await super().__call__(scope, receive, send)
        else:
            await self.door.serve(route, scope, receive, send)

    def openapi(self) -> dict[str, Any]:
        """FastAPI's schema, with the door's routes in it, whose request bodies are their models'
        own JSON schemas: FastAPI's OpenAPI model makes every bound a float, so ``le=2**63 - 1``
        would be published as 2**63, a value the models refuse."""
        if not self.openapi_schema:
            schema = get_openapi(
                title=self.title,
                version=self.version,
                openapi_version=self.openapi_version,
                description=self.description,
                routes=[*self.documented, *self.routes],
            )
            components = schema["components"]["schemas"]
            for route in self.door.routes.values():
                exact = route.model.model_json_schema(ref_template=_REF_TEMPLATE)
                components.update(exact.pop("$defs", {}))
                components[route.model.__name__] = exact
            self.openapi_schema = schema
        return self.openapi_schema


def _with_logprobs(renderer: Renderer, choice: Choice) -> Callable[[str, str | None], bytes]:
    """The renderer's ``delta``, each frame with the logprobs of the tokens since the last."""

    def delta(text: str, finish_reason: str | None) -> bytes:
        return renderer.delta(text, finish_reason, choice.take_logprobs())

    return delta


async def _on_http_exception(request: Request, exc: HTTPException) -> Response:
    return http_exception_response(exc)


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

    # --- generation endpoints ---------------------------------------------------------------

    async def chat_completions(self, request: Request, body: ChatCompletionRequest) -> Response:
        """Create a chat completion (OpenAI ``POST /v1/chat/completions``)."""
        m = self.metrics.start(CHAT_PATH)
        try:
            info = self._admit(body.model)
            prompt = await chat_prompt(info, body)
            rid = f"chatcmpl-{secrets.token_hex(16)}"
            max_tokens = body.max_completion_tokens or body.max_tokens
            guided = guided_decoding(body.response_format)
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            preq = build_request(rid, prompt, info, body, max_tokens, "messages", guided, logprobs)
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
            info = self._admit(body.model)
            prompt_text, prompt = await completion_prompt(info, body)
            rid = f"cmpl-{secrets.token_hex(16)}"
            # OpenAI's default for completions is 16 tokens (chat's is "the rest of the context").
            max_tokens = 16 if body.max_tokens is None else body.max_tokens
            preq = build_request(rid, prompt, info, body, max_tokens, "prompt", None, body.logprobs)
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            renderer = CompletionRenderer(
                rid, info.name, int(time.time()), include_usage=include_usage
            )
            echo = prompt_text if body.echo else ""
            return await self._generate(request, info, preq, renderer, body, m, echo)
        except RequestError as exc:
            return self._fail(m, exc)
        except Exception as exc:
            return self._internal(m, exc)

    def _admit(self, model: str) -> ModelInfo:
        info = next((i for i in self.backend.models() if i.name == model), None)
        if info is None:
            exc = ModelNotFound(f"The model `{model}` does not exist.")
            setattr(exc, "param", "model")  # noqa: B010
            raise exc
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
        choice = Choice(
            info.tokenizer.detokenizer(preq.token_ids),
            prompt_tokens=len(preq.token_ids),
            stop=preq.stop_conditions.stop or (),
            min_tokens=preq.stop_conditions.min_tokens or 0,
            logprobs=None if preq.logprobs is None else info.tokenizer,
        )
        if body.stream:
            # Everything that touches the backend runs in the response's task: the first output
            # (which decides the status line), the stream, the close. The response's disconnect
            # watcher covers all of it, the wait for the first output included.
            # Counted in flight now, so max_inflight holds however many requests arrive at once;
            # the producer's own finally (it always runs: the response always starts it) counts
            # it out.
            self._enter(m, info, preq, "stream")
            # A partial, not a coroutine around _stream: one frame less to resume per chunk.
            produce = partial(
                self._stream, info=info, preq=preq, choice=choice, renderer=renderer, m=m, echo=echo
            )
            return SSEResponse(produce, ping_s=self.ping_interval_s)
        self._enter(m, info, preq, "unary")
        return await self._unary(request, info, preq, choice, renderer, m, echo)

    def _enter(
        self, m: RequestMetrics, info: ModelInfo, preq: PreprocessedRequest, kind: str
    ) -> None:
        m.admitted(info.name, kind, len(preq.token_ids))
        self.inflight += 1

    async def _unary(
        self,
        request: Request,
        info: ModelInfo,
        preq: PreprocessedRequest,
        choice: Choice,
        renderer: Renderer,
        m: RequestMetrics,
        echo: str,
    ) -> Response:
        outputs = self.backend.generate(info.name, preq)

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
        body = renderer.body(text, finish, choice.final_usage(), choice.take_logprobs())
        return Response(body, media_type="application/json")

    async def _stream(
        self,
        writer: SSEWriter,
        info: ModelInfo,
        preq: PreprocessedRequest,
        choice: Choice,
        renderer: Renderer,
        m: RequestMetrics,
        echo: str,
    ) -> None:
        """Produce an SSE response: its head (see :class:`SSEWriter`), then the frames.

        Outputs that are already here when a write is due go out in that same write (several
        ``data:`` events in one body chunk); a frame never waits for a later output.
        """
        status, error_type = "cancelled", ""
        outputs: AsyncIterator[EngineOutput] | None = None
        try:
            try:
                outputs = self.backend.generate(info.name, preq)
                first = await next_output(outputs)
                text, finish = choice.on_output(first)
                m.tokens(len(first.token_ids))
            except RequestError as exc:
                # Nothing was sent yet: the error keeps its own status (and Retry-After).
                status, error_type = "error", error_type_label(exc)
                await writer.start(error_response(exc, retry_after_s=self.retry_after_s))
                return
            except Exception as exc:
                status, error_type = "error", "internal"
                log.error("request failed", exc_info=exc)
                await writer.start(internal_error_response())
                return
            await writer.start()  # a 200 stream follows
            frames: list[bytes] = []
            try:
                start = renderer.start()
                if start is not None:
                    frames.append(start)
                text = echo + text
                delta = (
                    _with_logprobs(renderer, choice) if choice.wants_logprobs else renderer.delta
                )
                if text or finish is not None:
                    frames.append(delta(text, finish))
                # The per-chunk loop: its callables looked up once, the iterator's __anext__
                # awaited directly (next_output's check is the except below).
                ready, receive = ready_output(outputs), outputs.__anext__
                on_output, tokens, send = choice.on_output, m.tokens, writer.send
                try:
                    while finish is None:
                        out = ready()
                        if out is None:
                            if frames:
                                await send(b"".join(frames))
                                frames.clear()
                            out = await receive()
                        text, finish = on_output(out)
                        tokens(len(out.token_ids))
                        if text or finish is not None:
                            frames.append(delta(text, finish))
                except StopAsyncIteration:
                    raise StreamIncomplete(STREAM_ENDED) from None
                status = "success"
                if renderer.include_usage:
                    frames.append(renderer.usage(choice.final_usage()))
            except RequestError as exc:
                status, error_type = "error", error_type_label(exc)
                # After the headers, the status line is gone: the error goes in the stream, and
                # the stream still ends properly.
                frames.append(error_frame(error_payload(exc)))
            except Exception as exc:
                status, error_type = "error", "internal"
                log.error("stream failed", exc_info=exc)
                frames.append(error_frame(error_body(500, "internal server error", "internal")))
            # Closed before the last write: once the client has the whole answer, the engine
            # request is over (aborted, if a stop string ended it early).
            closing, outputs = outputs, None
            await aclose_quietly(closing)
            frames.append(DONE_FRAME)
            await writer.end(b"".join(frames))
        finally:
            if outputs is not None:
                await aclose_quietly(outputs)
            self._finish(m, status, error_type, disconnected=writer.disconnected)

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
        return internal_error_response()

    async def on_request_error(self, request: Request, exc: RequestError) -> Response:
        return error_response(exc, retry_after_s=self.retry_after_s)
