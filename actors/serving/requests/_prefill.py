"""A disaggregated attempt: the client's first token comes from the prefill worker.

SGLang's prefill samples the request's first token; the decode worker streams it again as its
first output, but only once the KV has crossed over (prefill -> decode WRITE) and decode ran a
step. Taking the first token from the prefill's own output takes the transfer and that step out
of the client's time to first token. The decode's repeat of it is then dropped, after checking
it is the same token (else the attempt fails as a KV transfer error, migratable: the token the
client has counts as generated, as any other).

The prefill stream is read by the consumer for its first output only; the request-stream actor
drains the rest (it ends when the KV transfer reached a terminal state) once :attr:`Prefill.read`
is set: by the consumer after that first output, or by the actor when the attempt ends first.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import anyio

from actors import ActorError, ActorRef, ReplyStream
from actors.serving.requests._attempt import Attempt, Progress, without_first
from actors.serving.requests._trace import AttemptTrace
from actors.serving.routing import Routed
from protocols.engine import EngineOutput, ModelKind, PreprocessedRequest
from protocols.errors import InvalidRequest, KVTransferError, RequestError

if TYPE_CHECKING:
    from opentelemetry.trace import Span

__all__ = ["Prefill", "PrefillFirstAttempt"]


class Prefill:
    """An attempt's prefill: its worker and stream, and ``read`` once the consumer is done with
    the stream (the actor drains it from then on); ``span`` while tracing is on (the drain ends
    it)."""

    __slots__ = ("outputs", "read", "routed", "span")

    def __init__(
        self, routed: Routed, outputs: ReplyStream[EngineOutput], span: Span | None = None
    ) -> None:
        self.routed = routed
        self.outputs = outputs
        self.read = anyio.Event()
        self.span = span


class PrefillFirstAttempt(Attempt):
    """An :class:`Attempt` on a decode worker whose first output the prefill gives first."""

    __slots__ = ("_repeat", "prefill")

    def __init__(
        self,
        routed: Routed,
        request: PreprocessedRequest,
        outputs: ReplyStream[EngineOutput],
        progress: Progress,
        *,
        prefill: Prefill,
        model: str,
        stall_timeout: float,
        request_timeout: float,
        owner: ActorRef[Any] | None = None,
        kind: ModelKind = "chat",
        trace: AttemptTrace | None = None,
    ) -> None:
        super().__init__(
            routed,
            request,
            outputs,
            progress,
            model=model,
            stall_timeout=stall_timeout,
            request_timeout=request_timeout,
            owner=owner,
            kind=kind,
            trace=trace,
        )
        self.prefill: Prefill | None = prefill  # until its first output was read
        self._repeat: int | None = None  # the token the decode's first output repeats

    async def receive(self) -> EngineOutput:
        if self.prefill is not None:
            first = await self._from_prefill()
            if first is not None:
                return first
        return await super().receive()

    def receive_nowait(self) -> EngineOutput | None:
        if self.prefill is not None:
            return None  # the decode's outputs wait for the prefill's first
        return super().receive_nowait()

    def accept(self, output: EngineOutput) -> EngineOutput | None:
        repeat = self._repeat
        # (A draining worker's offer with no tokens: the repeat is still to come.)
        if repeat is not None and (output.token_ids or output.disaggregated_params is None):
            self._repeat = None
            if not output.token_ids or output.token_ids[0] != repeat:
                raise KVTransferError("decode did not resume from the prefill's first token")
            if self.trace is not None:
                self.trace.kv_transferred()
            output = without_first(output)
        return super().accept(output)

    def release_prefill(self) -> None:
        """Hand the prefill stream to the actor's drain (idempotent)."""
        prefill, self.prefill = self.prefill, None
        if prefill is not None:
            prefill.read.set()

    async def _from_prefill(self) -> EngineOutput | None:
        """The prefill's first token as the client's first output; ``None`` if it has none:
        whatever went wrong there, the decode stream reports it (a KV transfer error, a stall),
        but for a request the prefill engine refused (bad input, not worth a migration)."""
        prefill = self.prefill
        assert prefill is not None
        output = None
        left = self.progress.deadline - time.monotonic()
        try:
            if left > 0:
                output = await prefill.outputs.receive(min(self._stall, left))
        except InvalidRequest:
            raise
        except (StopAsyncIteration, TimeoutError, RequestError, ActorError):
            pass
        finally:
            self.release_prefill()  # cancelled too: the actor drains it
        if output is None or not output.token_ids:
            return None
        token = output.token_ids[0]
        self._repeat = token
        if self.trace is not None:
            self.trace.kv_transfer()
        # The prefill's finish (it ran one step) and bootstrap triple are its own, not the
        # client's: the decode's outputs say how the request goes on and ends.
        logprobs = None if output.logprobs is None else output.logprobs[:1]
        first = EngineOutput(
            token_ids=[token], logprobs=logprobs, prompt_logprobs=output.prompt_logprobs
        )
        return super().accept(first)
