"""One attempt of a request: one worker's reply stream and the rules each of its outputs goes
through on its way to the client.

The request-stream actor (``_request.py``) opens each attempt; its consumer reads it in its own
task (``_outputs.py``) through :meth:`Attempt.receive`, which applies the request's rules to
every output: migration timing, the repeated token of a live migration, usage counted against
the client's own prompt, and a draining worker's offer of the request's KV (:class:`Handover`,
told to the actor at once as :class:`Prepare`). An output with neither tokens nor a finish is
skipped, but for a block-diffusion (``dllm``) model, whose every output is a block: there it is
a migratable :class:`~protocols.errors.EmptyOutput` (as Dynamo's handler has it). The request's
:class:`Progress` is used by one side at a time, never by both.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import attrs
import msgspec

from actors import ActorError, ActorRef, ReplyStream
from actors.serving.requests._metrics import (
    CACHED_TOKENS,
    LIVE_MIGRATIONS,
    MIGRATION_SECONDS,
    PROMPT_TOKENS,
)
from actors.serving.requests._trace import AttemptTrace, RequestTrace
from actors.serving.routing import Routed
from protocols.engine import BootstrapInfo, EngineOutput, ModelKind, PreprocessedRequest, Usage
from protocols.errors import (
    EmptyOutput,
    KVTransferError,
    RequestTimeout,
    StreamIncomplete,
    StreamStalled,
)

__all__ = ["Attempt", "Handover", "Prepare", "Progress", "without_first"]


@attrs.frozen
class Handover:
    """A draining decode worker's offer: request ``rid``'s KV, readable at ``bootstrap``."""

    source: Routed
    rid: str
    bootstrap: BootstrapInfo


class Progress:
    """What one request produced so far, across its attempts."""

    __slots__ = (
        "deadline",
        "failed_at",
        "generated",
        "live",
        "migration_type",
        "original",
        "trace",
    )

    def __init__(
        self, original: PreprocessedRequest, deadline: float, trace: RequestTrace | None = None
    ) -> None:
        self.original = original
        self.trace = trace  # the request's span, while tracing is on
        self.deadline = deadline  # time.monotonic() past which the request times out
        self.generated: list[int] = []
        # A draining worker's offer of this request's KV, until an attempt took it (or it is
        # given back: on every other way out, the worker is told to free it).
        self.live: Handover | None = None
        self.failed_at: float | None = None  # when the migration under way began
        self.migration_type = "new_request"


class Attempt:
    """One try at serving the request on one worker: the engine's reply stream and the rules
    each of its outputs goes through.

    :meth:`receive` raises what ends the attempt (a :class:`~protocols.errors.RequestError` or
    an :class:`~actors.ActorError`), for the actor to decide what comes next; ``finished`` is
    set once the terminal output was handed out.
    """

    __slots__ = (
        "_blocks",
        "_model",
        "_owner",
        "_stall",
        "_timeout",
        "finished",
        "offer",
        "outputs",
        "progress",
        "request",
        "routed",
        "trace",
    )

    def __init__(
        self,
        routed: Routed,
        request: PreprocessedRequest,
        outputs: ReplyStream[EngineOutput],
        progress: Progress,
        *,
        model: str,
        stall_timeout: float,
        request_timeout: float,
        owner: ActorRef[Any] | None = None,
        kind: ModelKind = "chat",
        trace: AttemptTrace | None = None,
    ) -> None:
        self.routed = routed
        self.request = request
        self.outputs = outputs
        self.progress = progress
        self.offer: Handover | None = None  # this worker's offer of the KV (it is draining)
        self.finished = False
        self._model = model
        self._stall = stall_timeout
        self._timeout = request_timeout
        self._owner = owner  # the request stream, told of an offer (:class:`Prepare`)
        self._blocks = kind == "dllm"  # every output is a block: an empty one is an error
        self.trace = trace  # this attempt's span, while tracing is on (the actor ends it)

    async def receive(self) -> EngineOutput:
        """The next output for the client (empty ones are skipped, or fail: see the module)."""
        while True:
            left = self.progress.deadline - time.monotonic()
            if left <= 0:
                raise RequestTimeout(f"request exceeded {self._timeout} s")
            try:
                # A timed receive: no cancel scope (nor timer) per output.
                output = await self.outputs.receive(self._stall if self._stall < left else left)
            except StopAsyncIteration:
                raise StreamIncomplete("the engine stream ended without a finish reason") from None
            except TimeoutError:
                if left <= self._stall:
                    raise RequestTimeout(f"request exceeded {self._timeout} s") from None
                raise StreamStalled(
                    f"no output for {self._stall} s from {self.routed.worker_id}"
                ) from None
            if self._blocks:
                self._check_block(output)
            accepted = self.accept(output)
            if accepted is not None:
                return accepted

    def receive_nowait(self) -> EngineOutput | None:
        """An output already here for the client, or ``None``."""
        outputs = self.outputs
        while not self.finished and outputs.buffered:
            output = outputs.receive_nowait()
            if self._blocks:
                self._check_block(output)
            accepted = self.accept(output)
            if accepted is not None:
                return accepted
        return None

    def _check_block(self, output: EngineOutput) -> None:
        """A block-diffusion model's output as the engine sent it: raise :class:`EmptyOutput`
        if it has neither tokens nor a finish (a draining worker's offer aside)."""
        empty = not output.token_ids and output.finish_reason is None
        if empty and output.disaggregated_params is None:
            raise EmptyOutput(
                f"an output with neither tokens nor a finish from {self.routed.worker_id}"
            )

    def accept(self, output: EngineOutput) -> EngineOutput | None:
        """The request stream's rules for one engine output: what the client gets of it."""
        if output.disaggregated_params is not None and not output.finished:
            # A draining decode worker: where this request's KV waits for us.
            return self._offered(output)
        progress = self.progress
        if progress.failed_at is not None:
            MIGRATION_SECONDS.labels(self._model, progress.migration_type, "success").observe(
                time.monotonic() - progress.failed_at
            )
            progress.failed_at = None
        if progress.live is not None:
            output = _drop_repeated(output, progress.generated)
            LIVE_MIGRATIONS.labels(self._model, "success").inc()
            progress.live = None
        trace = progress.trace
        if trace is not None and not progress.generated and output.token_ids:
            trace.first_token()
        progress.generated.extend(output.token_ids)
        if output.finish_reason is not None:
            self.finished = True
            usage = output.usage
            if usage is not None and usage.cached_tokens is not None:
                worker = self.routed.worker_id
                PROMPT_TOKENS.labels(worker).inc(usage.prompt_tokens)
                CACHED_TOKENS.labels(worker).inc(usage.cached_tokens)
            final = _final(output, progress.original, progress.generated)
            if trace is not None:
                trace.finished(final)
            return final
        # An image engine's progress (a denoising step done) carries no tokens but is news.
        return output if output.token_ids or output.step is not None else None

    def _offered(self, output: EngineOutput) -> EngineOutput | None:
        """A draining worker's offer of the request's KV, after the tokens it comes with: noted
        for the migration its stream's end asks for and, where it says how far the KV goes,
        told to the request stream at once (it gets the next worker ready meanwhile)."""
        assert output.disaggregated_params is not None
        offer = self.offer = Handover(self.routed, self.request.rid, output.disaggregated_params)
        tokens = EngineOutput(token_ids=output.token_ids, logprobs=output.logprobs)
        passed = self.accept(tokens) if output.token_ids else None
        covered, owner = output.handover_tokens, self._owner
        if covered is not None and owner is not None:
            generated = self.progress.generated
            done = covered - len(self.progress.original.token_ids)
            if 0 <= done <= len(generated):
                with contextlib.suppress(ActorError):  # it ended: nothing to get ready for
                    owner.tell_nowait(Prepare(offer, generated[:done]))
        return passed


@attrs.frozen
class Prepare:
    """A draining worker offered the request's KV (a tell): it will hold the original prompt
    and ``generated``. The request stream may send the continuation to the next worker now,
    for the migration the attempt's end then asks for."""

    offer: Handover
    generated: list[int]


def _drop_repeated(output: EngineOutput, generated: list[int]) -> EngineOutput:
    """A live migration's first output, less the token it repeats (the newest before the hand-
    over: its KV was not handed over, so the new worker computes it again) and its logprob."""
    if not output.token_ids or output.token_ids[0] != generated[-1]:
        raise KVTransferError("the live-migrated request did not resume where it stopped")
    return without_first(output)


def without_first(output: EngineOutput) -> EngineOutput:
    """``output`` less its first token, and that token's logprob with it."""
    logprobs = None if output.logprobs is None else output.logprobs[1:]
    return msgspec.structs.replace(output, token_ids=output.token_ids[1:], logprobs=logprobs)


def _final(
    output: EngineOutput, original: PreprocessedRequest, generated: list[int]
) -> EngineOutput:
    """The terminal output, with usage counted against the client's own prompt."""
    cached = output.usage.cached_tokens if output.usage is not None else None
    usage = Usage(
        prompt_tokens=len(original.token_ids),
        completion_tokens=len(generated),
        cached_tokens=cached,
    )
    return msgspec.structs.replace(output, usage=usage)
