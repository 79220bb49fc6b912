"""The OpenAI-compatible ASGI app: routes, request mapping, streaming, disconnect handling."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import anyio
import structlog
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from actors.tracing import attach_headers, detach, tracer
from protocols.engine import EngineOutput, ModelKind, PreprocessedRequest
from protocols.errors import (
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    RequestError,
)

from ._auth import ApiKeys
from ._backend import Backend, ModelInfo
from ._choices import Part, best, choice_parts, pump, usage_of
from ._chunks import DONE_FRAME, ChatRenderer, CompletionRenderer, error_frame
from ._dashboard import DASHBOARD_PATH, EVENTS_PATH, Dashboard
from ._door import Door, GenerationRoute
from ._embeddings import (
    EMBEDDINGS_PATH,
    EmbeddingRequest,
    EmbeddingResponse,
    embedding_body,
    embedding_requests,
)
from ._errors import (
    error_body,
    error_payload,
    error_response,
    error_type_label,
    http_exception_response,
    internal_error_handler,
    internal_error_response,
)
from ._images import (
    IMAGES_PATH,
    ImageGenerationRequest,
    ImageResponse,
    ImageStore,
    image_body,
    image_entry,
    image_frames,
    image_requests,
)
from ._mapping import (
    build_request,
    chat_prompt,
    completion_prompts,
    guided_decoding,
    logit_bias,
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
)
from ._ops import Ops
from ._parsers import output_parser
from ._parsers._chat import tool_plan
from ._request_id import echoing, request_id_of
from ._sse import SSEResponse, SSEWriter
from ._streams import (
    FrameQueue,
    aclose_quietly,
    next_output,
    until_disconnected,
)

__all__ = ["create_app"]

log = logging.getLogger("actorserve.frontend")

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
#: Where images asked for as ``url`` go unless the app is given a store.
DEFAULT_IMAGE_DIR = "~/.cache/actorserve/images"
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
    api_keys: ApiKeys | None = None,
    images: ImageStore | None = None,
    dashboard: Dashboard | None = None,
) -> FastAPI:
    """The frontend's ASGI app for ``backend``.

    Frontend metrics are registered on ``registry``, which ``/metrics`` exposes (with the
    backend's own registry, if it has one). ``max_inflight`` caps concurrent generation requests
    (beyond it: 503 with ``Retry-After: retry_after_s``); larger bodies than ``max_body_bytes``
    get a 413. ``ping_interval_s > 0`` sends SSE keep-alive comments (``: ping``) during quiet
    stretches of a stream, for proxies that cut idle connections; off by default, like vLLM's and
    SGLang's servers, because the ping task costs about as much CPU per stream as the rest of the
    SSE machinery. With ``api_keys``, the requests that need a key and carry none of them get a
    401 (see :mod:`._auth`). Images asked for as ``url`` are written to ``images`` (by default a
    folder in the user's cache). With ``dashboard``, ``/dashboard`` serves the live supervision
    tree (see :mod:`._dashboard`).
    """
    frontend = _Frontend(backend, registry, max_inflight, retry_after_s, ping_interval_s)
    frontend.image_store = images or ImageStore(DEFAULT_IMAGE_DIR)
    ops = Ops(backend, registry)
    chat = GenerationRoute(CHAT_PATH, ChatCompletionRequest, frontend.chat_completions)
    completions = GenerationRoute(COMPLETIONS_PATH, CompletionRequest, frontend.completions)
    embeddings = GenerationRoute(EMBEDDINGS_PATH, EmbeddingRequest, frontend.embeddings)
    images_route = GenerationRoute(IMAGES_PATH, ImageGenerationRequest, frontend.images)
    door = Door([chat, completions, embeddings, images_route], max_body_bytes, frontend.metrics)
    app = _App(
        door,
        api_keys,
        [
            _documented(chat, ChatCompletionResponse),
            _documented(completions, CompletionResponse),
            _documented(embeddings, EmbeddingResponse),
            _documented(images_route, ImageResponse),
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
    if dashboard is not None:
        app.add_route(DASHBOARD_PATH, dashboard.page, include_in_schema=False)
        app.add_route(EVENTS_PATH, dashboard.events, include_in_schema=False)
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

    def __init__(
        self, door: Door, api_keys: ApiKeys | None, documented: list[APIRoute], **settings: Any
    ) -> None:
        super().__init__(**settings)
        self.door = door
        self.api_keys = api_keys
        self.documented = documented

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        request_id = request_id_of(scope)
        echo = (b"x-request-id", request_id)
        tokens = structlog.contextvars.bind_contextvars(request_id=request_id.decode())
        # While tracing: the client's traceparent, the parent of the request's spans.
        trace_token = None if tracer() is None else attach_headers(scope["headers"])
        try:
            if self.api_keys is not None:
                refusal = self.api_keys.refusal(scope)
                if refusal is not None:
                    refusal.raw_headers.append(echo)
                    await refusal(scope, receive, send)
                    return
            route = self.door.route(scope)
            if route is None:
                await super().__call__(scope, receive, echoing(send, echo))
            else:
                await self.door.serve(route, scope, receive, send, echo)
        finally:
            # The server may serve its next request in this task: nothing of this one stays.
            structlog.contextvars.reset_contextvars(**tokens)
            structlog.contextvars.unbind_contextvars("rid")
            if trace_token is not None:
                detach(trace_token)

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


def _late_error(exc: Exception) -> tuple[bytes, str]:
    """The SSE error event of a stream that failed after its status line (which is gone: the
    error goes in the stream, which still ends properly); and its error type label."""
    if isinstance(exc, RequestError):
        return error_frame(error_payload(exc)), error_type_label(exc)
    log.error("stream failed", exc_info=exc)
    return error_frame(error_body(500, "internal server error", "internal")), "internal"


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
        self.image_store = ImageStore(DEFAULT_IMAGE_DIR)

    # --- generation endpoints ---------------------------------------------------------------

    async def chat_completions(self, request: Request, body: ChatCompletionRequest) -> Response:
        """Create a chat completion (OpenAI ``POST /v1/chat/completions``)."""
        m = self.metrics.start(CHAT_PATH)
        try:
            info = self._admit(body.model)
            tools = tool_plan(body, info.tool_call_parser)
            prompt = await chat_prompt(info, body, tools)
            rid = f"chatcmpl-{secrets.token_hex(16)}"
            structlog.contextvars.bind_contextvars(rid=rid)  # logged next to the request_id
            max_tokens = body.max_completion_tokens or body.max_tokens
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            guided, bias = tools.grammar or guided_decoding(body), logit_bias(body, info)
            preq = build_request(
                rid, prompt, info, body, max_tokens, "messages", guided, logprobs, bias=bias
            )
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            created = int(time.time())

            def renderer(index: int) -> ChatRenderer:
                return ChatRenderer(
                    rid, info.name, created, include_usage=include_usage, index=index
                )

            parts = choice_parts(
                info, [(preq, "")], body.n, renderer, logprobs=logprobs is not None
            )
            for part in parts:
                part.parser = output_parser(
                    tool_parser=tools.parser,
                    # A grammar constrains the answer from its first token: no reasoning.
                    reasoning_parser=info.reasoning_parser if guided is None else None,
                    tool_names=tools.names,
                    max_calls=tools.max_calls,
                    separate_reasoning=body.separate_reasoning,
                )
            return await self._generate(request, info, parts, body.stream, body.n, m)
        except RequestError as exc:
            return self._fail(m, exc)
        except Exception as exc:
            return self._internal(m, exc)

    async def completions(self, request: Request, body: CompletionRequest) -> Response:
        """Create a text completion (OpenAI ``POST /v1/completions``)."""
        m = self.metrics.start(COMPLETIONS_PATH)
        try:
            info = self._admit(body.model)
            prompts = await completion_prompts(info, body)
            rid = f"cmpl-{secrets.token_hex(16)}"
            structlog.contextvars.bind_contextvars(rid=rid)  # logged next to the request_id
            # OpenAI's default for completions is 16 tokens (chat's is "the rest of the context").
            max_tokens = 16 if body.max_tokens is None else body.max_tokens
            copies = body.best_of or body.n
            ranked = copies > body.n
            # Ranking the choices of best_of needs their logprobs, asked for or not.
            logprobs = body.logprobs if body.logprobs is not None or not ranked else 0
            echoed = body.logprobs if body.echo else None
            guided, bias = guided_decoding(body), logit_bias(body, info)
            preqs = [
                (
                    build_request(
                        rid,
                        ids,
                        info,
                        body,
                        max_tokens,
                        "prompt",
                        guided,
                        logprobs,
                        bias=bias,
                        prompt_logprobs=echoed,
                    ),
                    text if body.echo else "",
                )
                for text, ids in prompts
            ]
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            created = int(time.time())

            def renderer(index: int) -> CompletionRenderer:
                return CompletionRenderer(
                    rid, info.name, created, include_usage=include_usage, index=index
                )

            parts = choice_parts(
                info,
                preqs,
                copies,
                renderer,
                logprobs=body.logprobs is not None,
                echo=echoed is not None,
                ranked=ranked,
            )
            return await self._generate(request, info, parts, body.stream, body.n, m)
        except RequestError as exc:
            return self._fail(m, exc)
        except Exception as exc:
            return self._internal(m, exc)

    async def embeddings(self, request: Request, body: EmbeddingRequest) -> Response:
        """Embed texts or token ids (OpenAI ``POST /v1/embeddings``)."""
        m = self.metrics.start(EMBEDDINGS_PATH)
        try:
            info = self._admit(body.model, ("embedding",))
            preqs = await embedding_requests(info, body)
            self._enter(m, info, sum(len(p.token_ids) for p in preqs), "unary")
            outputs = await self._last_outputs(request, info, preqs)
            if outputs is None:
                self._finish(m, "cancelled", disconnected=True)
                return Response(status_code=499)
            content = embedding_body(info.name, outputs, body.encoding_format)
            self._finish(m, "success")
            return Response(content, media_type="application/json")
        except RequestError as exc:
            return self._fail(m, exc)
        except Exception as exc:
            return self._internal(m, exc)

    async def images(self, request: Request, body: ImageGenerationRequest) -> Response:
        """Generate pictures (OpenAI ``POST /v1/images/generations``)."""
        m = self.metrics.start(IMAGES_PATH)
        try:
            info = self._admit(body.model, ("image",))
            preqs = image_requests(body)
            if body.stream:
                self._enter(m, info, 0, "stream")
                produce = image_frames(preqs, body, self.image_store)
                return SSEResponse(
                    partial(self._stream_several, info=info, preqs=preqs, m=m, produce=produce),
                    ping_s=self.ping_interval_s,
                )
            self._enter(m, info, 0, "unary")
            outputs = await self._last_outputs(request, info, preqs)
            if outputs is None:
                self._finish(m, "cancelled", disconnected=True)
                return Response(status_code=499)
            entries = [
                await image_entry(self.image_store, preq, out, body.response_format)
                for preq, out in zip(preqs, outputs, strict=True)
            ]
            self._finish(m, "success")
            return Response(image_body(entries), media_type="application/json")
        except RequestError as exc:
            return self._fail(m, exc)
        except Exception as exc:
            return self._internal(m, exc)

    async def _last_outputs(
        self, request: Request, info: ModelInfo, preqs: Sequence[PreprocessedRequest]
    ) -> list[EngineOutput] | None:
        """Each engine request's final output (``None``: the client left first, and every
        request was cancelled)."""
        outputs: list[EngineOutput | None] = [None] * len(preqs)

        async def last(index: int, stream: AsyncIterator[EngineOutput]) -> None:
            out = await next_output(stream)
            while not out.finished:
                out = await next_output(stream)
            outputs[index] = out

        _, disconnected = await until_disconnected(
            request.receive, partial(self._each, info, preqs, last)
        )
        if disconnected:
            return None
        return [out for out in outputs if out is not None]

    def _admit(self, model: str, kinds: tuple[ModelKind, ...] = ("chat", "dllm")) -> ModelInfo:
        info = next((i for i in self.backend.models() if i.name == model), None)
        if info is None:
            exc: RequestError = ModelNotFound(f"The model `{model}` does not exist.")
            setattr(exc, "param", "model")  # noqa: B010
            raise exc
        if info.kind not in kinds:
            exc = InvalidRequest(
                f"The model `{model}` serves {info.kind}; this endpoint takes "
                + " or ".join(kinds)
                + " models."
            )
            setattr(exc, "param", "model")  # noqa: B010
            raise exc
        if self.max_inflight is not None and self.inflight >= self.max_inflight:
            raise Overloaded(f"too many requests in flight (limit {self.max_inflight})")
        return info

    async def _generate(
        self,
        request: Request,
        info: ModelInfo,
        parts: list[Part],
        stream: bool,
        n: int,
        m: RequestMetrics,
    ) -> Response:
        """Serve ``parts``, the choices of a request (``n`` of each prompt returned)."""
        prompt_tokens = sum(len(part.preq.token_ids) for part in parts if part.first)
        if stream:
            # Everything that touches the backend runs in the response's task: the first output
            # (which decides the status line), the stream, the close. The response's disconnect
            # watcher covers all of it, the wait for the first output included.
            # Counted in flight now, so max_inflight holds however many requests arrive at once;
            # the producer's own finally (it always runs: the response always starts it) counts
            # it out.
            self._enter(m, info, prompt_tokens, "stream")
            # A partial, not a coroutine around _stream: one frame less to resume per chunk.
            if len(parts) == 1:
                produce = partial(self._stream, info=info, part=parts[0], m=m)
            else:
                produce = partial(self._stream_choices, info=info, parts=parts, m=m)
            return SSEResponse(produce, ping_s=self.ping_interval_s)
        self._enter(m, info, prompt_tokens, "unary")
        return await self._unary(request, info, parts, n, m)

    def _enter(self, m: RequestMetrics, info: ModelInfo, prompt_tokens: int, kind: str) -> None:
        m.admitted(info.name, kind, prompt_tokens)
        self.inflight += 1

    async def _each(
        self,
        info: ModelInfo,
        preqs: Sequence[PreprocessedRequest],
        consume: Callable[[int, AsyncIterator[EngineOutput]], Awaitable[None]],
    ) -> None:
        """``consume`` the outputs of every engine request (with its index), all at once (one
        task each, when there are several); the first failure cancels the others and is raised
        as it is. Each request's outputs are closed (the request aborted, if unfinished) as its
        consumer ends."""
        if len(preqs) == 1:
            await self._consume(info, 0, preqs[0], consume)
            return
        failures: list[Exception] = []
        async with anyio.create_task_group() as tg:

            async def run(index: int, preq: PreprocessedRequest) -> None:
                try:
                    await self._consume(info, index, preq, consume)
                except Exception as exc:
                    failures.append(exc)
                    tg.cancel_scope.cancel()

            for index, preq in enumerate(preqs):
                tg.start_soon(run, index, preq)
        if failures:
            raise failures[0]

    async def _consume(
        self,
        info: ModelInfo,
        index: int,
        preq: PreprocessedRequest,
        consume: Callable[[int, AsyncIterator[EngineOutput]], Awaitable[None]],
    ) -> None:
        outputs = self.backend.generate(info.name, preq)
        try:
            await consume(index, outputs)
        finally:
            await aclose_quietly(outputs)

    async def _unary(
        self,
        request: Request,
        info: ModelInfo,
        parts: list[Part],
        n: int,
        m: RequestMetrics,
    ) -> Response:
        tokens = m.tokens

        async def collect(index: int, outputs: AsyncIterator[EngineOutput]) -> None:
            part = parts[index]
            texts = [part.echo]
            while True:
                out = await next_output(outputs)
                text, finish = part.choice.on_output(out)
                tokens(len(out.token_ids))
                texts.append(text)
                if finish is not None:
                    part.result = "".join(texts), finish
                    return

        _, disconnected = await until_disconnected(
            request.receive, partial(self._each, info, [p.preq for p in parts], collect)
        )
        if disconnected:
            self._finish(m, "cancelled", disconnected=True)
            return Response(status_code=499)
        self._finish(m, "success")
        renderer = parts[0].renderer
        choices = []
        for index, part in enumerate(best(parts, n)):
            assert part.result is not None
            text, finish = part.result
            logprobs = part.choice.take_logprobs()
            if part.parser is not None:
                assert isinstance(part.renderer, ChatRenderer)
                part.parser.feed(text)
                part.parser.finish()
                choices.append(part.renderer.parsed_choice(index, part.parser, finish, logprobs))
            else:
                choices.append(part.renderer.choice(index, text, finish, logprobs))
        body = renderer.body(choices, usage_of(parts))
        return Response(body, media_type="application/json")

    async def _stream(
        self, writer: SSEWriter, info: ModelInfo, part: Part, m: RequestMetrics
    ) -> None:
        """Produce the SSE response of one choice: its head (see :class:`SSEWriter`), then the
        frames.

        Outputs that are already here when a write is due go out in that same write (several
        ``data:`` events in one body chunk); a frame never waits for a later output.
        """
        status, error_type = "cancelled", ""
        outputs: AsyncIterator[EngineOutput] | None = None
        choice, renderer = part.choice, part.renderer
        try:
            try:
                outputs = self.backend.generate(info.name, part.preq)
                first = await next_output(outputs)
                text, finish = choice.on_output(first)
                m.tokens(len(first.token_ids))
            except Exception as exc:
                head, error_type = self._early_error(exc)
                status = "error"
                await writer.start(head)
                return
            await writer.start()  # a 200 stream follows
            frames: list[bytes] = []
            try:
                await pump(part, outputs, text, finish, frames, writer.send, m.tokens)
                status = "success"
                if renderer.include_usage:
                    frames.append(renderer.usage(choice.final_usage()))
            except Exception as exc:
                frame, error_type = _late_error(exc)
                status = "error"
                frames.append(frame)
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

    async def _stream_choices(
        self, writer: SSEWriter, info: ModelInfo, parts: list[Part], m: RequestMetrics
    ) -> None:
        """Produce the SSE response of several choices, all generated at once (see
        :meth:`_stream_several`); usage last, if asked for."""
        tokens = m.tokens

        async def produce(
            index: int, first: EngineOutput, outputs: AsyncIterator[EngineOutput], queue: FrameQueue
        ) -> None:
            part = parts[index]
            text, finish = part.choice.on_output(first)
            tokens(len(first.token_ids))
            frames: list[bytes] = []
            try:
                await pump(part, outputs, text, finish, frames, queue.put, tokens)
            finally:
                if frames:  # the last frames, or those before a failure (put never waits)
                    await queue.put(b"".join(frames))

        def usage() -> list[bytes]:
            renderer = parts[0].renderer
            return [renderer.usage(usage_of(parts))] if renderer.include_usage else []

        await self._stream_several(writer, info, [p.preq for p in parts], m, produce, usage)

    async def _stream_several(
        self,
        writer: SSEWriter,
        info: ModelInfo,
        preqs: Sequence[PreprocessedRequest],
        m: RequestMetrics,
        produce: Callable[
            [int, EngineOutput, AsyncIterator[EngineOutput], FrameQueue], Awaitable[None]
        ],
        tail: Callable[[], list[bytes]] = list,
    ) -> None:
        """Produce the SSE response of several engine requests, all run at once: ``produce``
        turns each one's outputs (its first, then the rest) into frames it queues; ``tail`` gives
        the frames after the last, when all succeeded.

        This task alone writes the queued frames, all that are queued at each write, so failing
        or cancelling a request's task never cuts a write in half. The status line goes out once
        every request has its first output: a failure before that keeps its own status, a later
        one is an SSE error event.
        """
        status, error_type = "cancelled", ""
        queue = FrameQueue()
        failure: Exception | None = None
        early = False  # the failure came before every request had its first output
        waiting, started = len(preqs), anyio.Event()

        async def consume(index: int, outputs: AsyncIterator[EngineOutput]) -> None:
            nonlocal waiting
            first = await next_output(outputs)
            waiting -= 1
            if not waiting:
                started.set()
            await produce(index, first, outputs, queue)

        async def generate() -> None:
            nonlocal failure, early
            try:
                await self._each(info, preqs, consume)
            except Exception as exc:
                failure, early = exc, not started.is_set()
            started.set()
            queue.close()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(generate)
                await started.wait()
                if early:
                    assert failure is not None
                    head, error_type = self._early_error(failure)
                    status = "error"
                    await writer.start(head)
                    return
                await writer.start()  # a 200 stream follows
                frames = await queue.take()
                while not queue.closed:
                    await writer.send(frames)
                    frames = await queue.take()
            ending = [frames]
            if failure is None:
                status = "success"
                ending.extend(tail())
            else:
                frame, error_type = _late_error(failure)
                status = "error"
                ending.append(frame)
            ending.append(DONE_FRAME)
            await writer.end(b"".join(ending))
        finally:
            self._finish(m, status, error_type, disconnected=writer.disconnected)

    # --- outcomes ---------------------------------------------------------------------------

    def _early_error(self, exc: Exception) -> tuple[Response, str]:
        """The response of a stream that failed before its status line, which keeps the error's
        own status (and Retry-After); and its error type label."""
        if isinstance(exc, RequestError):
            return error_response(exc, retry_after_s=self.retry_after_s), error_type_label(exc)
        log.error("request failed", exc_info=exc)
        return internal_error_response(), "internal"

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
