"""A request's attempts, and the iterator its consumer reads them through.

The request-stream actor (``_request.py``) decides each attempt: it routes the request, opens
the engine's reply stream and, when an attempt fails, migrates the request or gives up. The
outputs of an attempt go from the engine's reply stream to the client in the consumer's own task
(the frontend's), through the request stream's rules for each output (:meth:`Attempt.accept`),
with no hop through the actor's task: a hop cost an event-loop turn, a channel and a generator
chain per output. The consumer hands a failed attempt back to the actor (:class:`Retry`) and
tells it when the request is over (:class:`Finish`); the request's :class:`Progress` is used by
one side at a time, never by both.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import attrs
import msgspec

from actors import ActorError, ActorRef, Call, ReplyStream
from actors.serving.requests._metrics import LIVE_MIGRATIONS, MIGRATION_SECONDS
from actors.serving.routing import Routed
from protocols.engine import BootstrapInfo, EngineOutput, PreprocessedRequest, Usage
from protocols.errors import (
    KVTransferError,
    RequestError,
    RequestTimeout,
    StreamIncomplete,
    StreamStalled,
)

__all__ = [
    "Attempt",
    "Begin",
    "Finish",
    "Handover",
    "Prepare",
    "Progress",
    "RequestOutputs",
    "Retry",
    "Ticket",
]


@attrs.frozen
class Handover:
    """A draining decode worker's offer: request ``rid``'s KV, readable at ``bootstrap``."""

    source: Routed
    rid: str
    bootstrap: BootstrapInfo


class Progress:
    """What one request produced so far, across its attempts."""

    __slots__ = ("deadline", "failed_at", "generated", "live", "migration_type", "original")

    def __init__(self, original: PreprocessedRequest, deadline: float) -> None:
        self.original = original
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

    async def receive(self) -> EngineOutput:
        """The next output for the client (empty ones are skipped)."""
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
            accepted = self.accept(output)
            if accepted is not None:
                return accepted

    def receive_nowait(self) -> EngineOutput | None:
        """An output already here for the client, or ``None``."""
        outputs = self.outputs
        while not self.finished and outputs.buffered:
            accepted = self.accept(outputs.receive_nowait())
            if accepted is not None:
                return accepted
        return None

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
        progress.generated.extend(output.token_ids)
        if output.finish_reason is not None:
            self.finished = True
            return _final(output, progress.original, progress.generated)
        return output if output.token_ids else None

    def _offered(self, output: EngineOutput) -> EngineOutput | None:
        """A draining worker's offer of the request's KV, after the tokens it comes with: noted
        for the migration its stream's end asks for and, where it says how far the KV goes,
        told to the request stream at once (it gets the next worker ready meanwhile)."""
        assert output.disaggregated_params is not None
        offer = self.offer = Handover(self.routed, self.request.rid, output.disaggregated_params)
        passed = self.accept(EngineOutput(token_ids=output.token_ids)) if output.token_ids else None
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
    for the migration the attempt's end then asks for (:class:`Retry`)."""

    offer: Handover
    generated: list[int]


class Ticket:
    """The consumer's hold on its request stream: the stream's ref, set once the stream took
    the request (from then on the consumer tells it :class:`Finish`), and ``closed``, set by a
    consumer that gave up before (the stream then ends the request at once). Both are set in
    the one event loop with no await in between, so a consumer that never learned the ref, its
    start cancelled, still ends its stream."""

    __slots__ = ("closed", "ref")

    def __init__(self) -> None:
        self.ref: ActorRef[Any] | None = None
        self.closed = False


@attrs.frozen
class Begin(Call[Attempt]):
    """Start serving ``request``: its first attempt."""

    request: PreprocessedRequest
    ticket: Ticket = attrs.field(factory=Ticket)


@attrs.frozen
class Retry(Call[Attempt]):
    """The attempt failed with ``error``: the next one (a migration), or the terminal error."""

    attempt: Attempt
    error: BaseException


@attrs.frozen
class Finish:
    """The request is over (a tell): ``cancelled`` if its consumer gave up before the end."""

    cancelled: bool


class RequestOutputs:
    """The outputs of one request, served by a request-stream actor; each attempt's outputs read
    in the caller's task. :meth:`aclose` ends the request (a client cancel if it had not ended):
    always call it.

    Subclasses may start the actor lazily (:meth:`begin`, awaited on the first output).
    """

    __slots__ = ("_attempt", "_closed", "_error", "_ref", "_ticket", "request")

    def __init__(self, ref: ActorRef[Any] | None, request: PreprocessedRequest) -> None:
        self._ref = ref
        self.request = request
        self._ticket = Ticket()
        self._attempt: Attempt | None = None
        self._error: BaseException | None = None  # found by next_nowait, for __anext__
        self._closed = False

    async def begin(self, message: Begin) -> Attempt:
        """Ask the request-stream actor to serve the request (the one given, by default)."""
        assert self._ref is not None
        attempt: Attempt = await self._ref.ask(message, timeout=None)
        return attempt

    def __aiter__(self) -> RequestOutputs:
        return self

    async def __anext__(self) -> EngineOutput:
        attempt = self._attempt
        if attempt is None:
            if self._closed:
                raise StopAsyncIteration
            attempt = self._attempt = await self.begin(Begin(self.request, self._ticket))
        elif attempt.finished:
            raise StopAsyncIteration
        while True:
            error, self._error = self._error, None
            if error is None:
                try:
                    return await attempt.receive()
                except (RequestError, ActorError) as exc:
                    error = exc
            ref = self._ticket.ref
            assert ref is not None  # it took the request: it gave us the attempt
            # The actor decides: the next attempt, or it raises the request's terminal error.
            attempt = self._attempt = await ref.ask(Retry(attempt, error), timeout=None)

    def next_nowait(self) -> EngineOutput | None:
        """An output that is already here, or ``None`` (never waits, never raises: what ends an
        attempt is for :meth:`__anext__` to handle)."""
        attempt = self._attempt
        # Nothing buffered (the usual case between outputs): no call into the attempt.
        if attempt is None or self._error is not None or not attempt.outputs.buffered:
            return None
        try:
            return attempt.receive_nowait()
        except (RequestError, ActorError) as exc:
            self._error = exc
            return None

    @property
    def closed(self) -> bool:
        return self._closed

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """:meth:`aclose` without waiting (it never needs to)."""
        if self._closed:
            return
        self._closed = True
        attempt = self._attempt
        finished = attempt is not None and attempt.finished
        if attempt is not None and not finished:
            attempt.outputs.close()  # abort the engine request at once
        ticket = self._ticket
        ref = ticket.ref or self._ref
        if ref is None:
            ticket.closed = True  # not taken yet (or never will be): it ends it on taking it
            return
        try:
            ref.tell_nowait(Finish(cancelled=not finished))
        except ActorError:
            pass  # it ended already (a terminal error stops it)


def _drop_repeated(output: EngineOutput, generated: list[int]) -> EngineOutput:
    """A live migration's first output, less the token it repeats (the newest before the hand-
    over: its KV was not handed over, so the new worker computes it again)."""
    if not output.token_ids or output.token_ids[0] != generated[-1]:
        raise KVTransferError("the live-migrated request did not resume where it stopped")
    return msgspec.structs.replace(output, token_ids=output.token_ids[1:])


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
