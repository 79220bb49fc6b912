"""Test doubles for apps that embed the serving frontend.

:class:`FakeBackend` implements the frontend's :class:`~actors.serving.frontend.Backend` protocol
with no engine behind it: one model (:data:`MODEL`, :data:`CONTEXT` tokens of context) whose every
answer is :data:`ANSWER`, streamed in chunks, with knobs for errors, delays, hangs and truncation.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence

import anyio
from prometheus_client import CollectorRegistry, Counter

from actors.serving.frontend import (
    ByteTokenizer,
    ModelHealth,
    ModelInfo,
    Tokenizer,
    WorkerHealth,
    WorkerState,
)
from protocols.engine import EngineOutput, FinishReason, PreprocessedRequest, TokenLogprob, Usage

__all__ = ["ANSWER", "CONTEXT", "MODEL", "FakeBackend"]

MODEL = "mock-model"
CONTEXT = 256
ANSWER = "Héllo wörld 🎉! The answer is 42. STOP here, then more text follows."


class FakeBackend:
    """Streams ``ANSWER`` (encoded by the model's tokenizer) ``chunk`` tokens per output.

    Knobs a test sets before its requests: ``error_before`` (raised by ``generate``),
    ``error_after`` (raised after that many outputs), ``delay`` (seconds before each output),
    ``hang_after`` (after that many outputs, wait forever), ``finish_error`` (the terminal output
    says ``error``), ``truncate`` (end without a finish reason), ``ready``, ``answer_of`` (the
    answer of each request, instead of ``answer``). A request that asks for logprobs gets
    made-up ones: each token the most likely, its alternatives the next ids; its prompt's too
    (``prompt_logprobs``), on the first output. It records every request, and which ones were
    cancelled (closed before they finished).
    """

    def __init__(self, tokenizer: Tokenizer | None = None, *, answer: str = ANSWER) -> None:
        self.tokenizer: Tokenizer = tokenizer or ByteTokenizer()
        self.answer = answer
        self.chunk = 3
        self.delay = 0.0
        self.error_before: Exception | None = None
        self.error_after: tuple[int, Exception] | None = None
        self.hang_after: int | None = None
        self.finish_error: str | None = None
        self.truncate = False
        self.answer_of: Callable[[PreprocessedRequest], str] | None = None
        self.ready = True
        self.requests: list[PreprocessedRequest] = []
        self.cancelled: list[str] = []
        self.completed: list[str] = []
        self.cancel_seen = anyio.Event()
        self.request_seen = anyio.Event()
        self.extra_registry = CollectorRegistry()
        self.backend_counter = Counter(
            "fake_backend_calls", "Calls to generate.", registry=self.extra_registry
        )

    def models(self) -> list[ModelInfo]:
        return [ModelInfo(name=MODEL, context_length=CONTEXT, tokenizer=self.tokenizer)]

    def health(self) -> Mapping[str, ModelHealth]:
        state: WorkerState = "ready" if self.ready else "restarting"
        workers = {
            "prefill-0": WorkerHealth("prefill", "ready"),
            "decode-0": WorkerHealth("decode", state),
        }
        reason = None if self.ready else "no routable decode worker"
        return {MODEL: ModelHealth(self.ready, reason, workers)}

    def metrics_registry(self) -> CollectorRegistry | None:
        return self.extra_registry

    def generate(self, model: str, request: PreprocessedRequest) -> AsyncIterator[EngineOutput]:
        self.backend_counter.inc()
        if self.error_before is not None:
            raise self.error_before
        self.requests.append(request)
        self.request_seen.set()
        return self._outputs(request)

    async def _outputs(self, request: PreprocessedRequest) -> AsyncGenerator[EngineOutput, None]:
        answer = self.answer if self.answer_of is None else self.answer_of(request)
        ids = self.tokenizer.encode(answer, add_special_tokens=False)
        limit = request.stop_conditions.max_tokens
        reason: FinishReason = "stop"
        if limit is not None and limit < len(ids):
            ids, reason = ids[:limit], "length"
        pieces = [ids[i : i + self.chunk] for i in range(0, len(ids), self.chunk)]
        prompt_logprobs = _logprobs(request.token_ids[1:], request.prompt_logprobs)
        finished = False
        try:
            for n, piece in enumerate(pieces):
                logprobs = _logprobs(piece, request.logprobs)
                prompt = prompt_logprobs if n == 0 else None
                if self.error_after is not None and n == self.error_after[0]:
                    raise self.error_after[1]
                if self.hang_after is not None and n == self.hang_after:
                    await anyio.sleep_forever()
                if self.delay:
                    await anyio.sleep(self.delay)
                last = n == len(pieces) - 1
                if last and self.truncate:
                    yield EngineOutput(token_ids=piece, logprobs=logprobs, prompt_logprobs=prompt)
                    finished = True
                    return
                if last:
                    usage = Usage(
                        prompt_tokens=len(request.token_ids),
                        completion_tokens=len(ids),
                        cached_tokens=2,
                    )
                    finished = True
                    if self.finish_error is not None:
                        yield EngineOutput(
                            token_ids=piece,
                            finish_reason="error",
                            error=self.finish_error,
                            logprobs=logprobs,
                            prompt_logprobs=prompt,
                        )
                        return
                    yield EngineOutput(
                        token_ids=piece,
                        finish_reason=reason,
                        usage=usage,
                        logprobs=logprobs,
                        prompt_logprobs=prompt,
                    )
                    return
                yield EngineOutput(token_ids=piece, logprobs=logprobs, prompt_logprobs=prompt)
        finally:
            # Reached without "finished": the consumer closed or cancelled us mid-stream.
            if finished:
                self.completed.append(request.rid)
            else:
                self.cancelled.append(request.rid)
                self.cancel_seen.set()


def _logprobs(tokens: Sequence[int], top: int | None) -> list[TokenLogprob] | None:
    """Made-up logprobs for ``tokens`` (``top`` alternatives each), or ``None`` for no request."""
    if top is None:
        return None
    return [
        TokenLogprob(-0.25, [t + i for i in range(top)], [-0.25 - i for i in range(top)])
        for t in tokens
    ]
