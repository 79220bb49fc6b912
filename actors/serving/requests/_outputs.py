"""Opening a request, and the iterator its consumer (the frontend) reads it through.

:func:`open_request` admits the request and returns its :class:`RequestOutputs`. The first
``__anext__`` starts the request's stream actor with :class:`NextAttempt` already in its mailbox
(``SupervisorRef.start_dynamic_ask``: the start and the first ask are one round trip); the actor
answers with the first attempt, whose outputs the consumer then reads in its own task, with no
hop through the actor's (a hop cost an event-loop turn, a channel and a generator chain per
output). An attempt that fails goes back to the actor (:class:`NextAttempt` again, with its
error): it answers with the next attempt, or raises the request's terminal error. Closing the
outputs (always done) tells the actor the request is over (:class:`Finish`) and counts the
request out of admission.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import attrs
import structlog

from actors import ActorError, ActorRef, AskTimeout, Call
from actors.serving.requests._admission import Admission
from actors.serving.requests._attempt import Attempt
from actors.serving.routing import RoutingTable
from actors.tracing import current_context, tracer
from protocols.engine import EngineOutput, PreprocessedRequest
from protocols.errors import NoWorkerAvailable, RequestError, RequestTimeout
from supervisors import SupervisorRef

if TYPE_CHECKING:
    from opentelemetry.context import Context

__all__ = ["Finish", "NextAttempt", "RequestOutputs", "open_request"]


def open_request(
    streams: SupervisorRef,
    table: RoutingTable,
    admission: Admission,
    request: PreprocessedRequest,
    *,
    timeout: float,
) -> RequestOutputs:
    """Admit ``request`` (which may take ``timeout`` seconds in all) and return its outputs;
    its stream actor (a temporary child of ``streams``) starts on the first ``__anext__``.
    Raises ``NoWorkerAvailable`` while no worker is routable for one of the roles a request
    needs and ``WorkerDraining`` once admission closed."""
    if not table.serving():
        raise NoWorkerAvailable("no worker of every role the model needs is ready")
    admission.enter()
    return RequestOutputs(streams, request, admission, timeout)


@attrs.frozen
class NextAttempt(Call[Attempt]):
    """The request's next attempt: its first (``failed`` is ``None``: the message that starts
    the stream actor), or the one after ``failed`` ended with ``error`` (a migration). The actor
    raises the request's terminal error instead when there is none."""

    outputs: RequestOutputs
    failed: Attempt | None = None
    error: BaseException | None = None


@attrs.frozen
class Finish:
    """The request is over (a tell): ``cancelled`` if its consumer gave up before the end."""

    cancelled: bool


_ANSWER_GRACE_S = 5.0
_FINISHED = Finish(cancelled=False)
_CANCELLED = Finish(cancelled=True)


class RequestOutputs:
    """The outputs of one request, each attempt's read in the caller's task. :meth:`close` (or
    :meth:`aclose`) ends the request (a client cancel if it had not ended): always call it.

    ``owner`` is the stream actor, set once it took the request (from then on closing tells it
    :class:`Finish`); a consumer that closes before that leaves ``closed`` for the actor to see
    when it takes the request (it then ends it at once). Both are set in the one event loop with
    no await in between, so a consumer whose start was cancelled still ends its stream.
    """

    __slots__ = (
        "_admission",
        "_attempt",
        "_closed",
        "_error",
        "_streams",
        "_timeout",
        "deadline",
        "log_context",
        "owner",
        "request",
        "trace_start",
    )

    def __init__(
        self,
        streams: SupervisorRef,
        request: PreprocessedRequest,
        admission: Admission,
        timeout: float,
    ) -> None:
        self._streams = streams
        self.request = request
        self._admission = admission
        self._timeout = timeout
        self.owner: ActorRef[Any] | None = None
        self.deadline = math.inf  # the request's, set with ``owner``: its asks wait no longer
        self._attempt: Attempt | None = None
        self._error: BaseException | None = None  # found by next_nowait, for __anext__
        self._closed = False
        # The caller's structlog context (the request's id), for the stream actor's lines.
        self.log_context = structlog.contextvars.get_contextvars()
        # While tracing: the caller's trace context (the client's) and the admission time, which
        # the stream actor's span of the request starts from.
        self.trace_start: tuple[Context, int] | None = (
            None if tracer() is None else (current_context(), time.time_ns())
        )

    async def _start(self) -> Attempt:
        # The actor starts with the request in its mailbox: it routes and sends it to the
        # engine as soon as it runs, before its start is even confirmed to us. A streams
        # supervisor or actor that never answers ends the request as timed out, as below.
        try:
            started = await self._streams.start_dynamic_ask(
                NextAttempt(self), timeout=self._timeout + _ANSWER_GRACE_S
            )
        except TimeoutError:
            raise RequestTimeout("the request ran past its deadline") from None
        if started is None:
            raise NoWorkerAvailable("the request could not be started")
        return started[1]

    def __aiter__(self) -> RequestOutputs:
        return self

    async def __anext__(self) -> EngineOutput:
        attempt = self._attempt
        if attempt is None:
            if self._closed:
                raise StopAsyncIteration
            attempt = self._attempt = await self._start()
        elif attempt.finished:
            raise StopAsyncIteration
        while True:
            error, self._error = self._error, None
            if error is None:
                try:
                    return await attempt.receive()
                except (RequestError, ActorError) as exc:
                    error = exc
            owner = self.owner
            assert owner is not None  # it took the request: it gave us the attempt
            # The actor decides: the next attempt, or it raises the request's terminal error. It
            # answers within the request's deadline; the grace covers its own reply, and a hung
            # actor ends the request as timed out rather than holding its client.
            left = self.deadline - time.monotonic() + _ANSWER_GRACE_S
            try:
                attempt = self._attempt = await owner.ask(
                    NextAttempt(self, attempt, error), timeout=max(left, _ANSWER_GRACE_S)
                )
            except AskTimeout:
                raise RequestTimeout("the request ran past its deadline") from None

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
        owner = self.owner
        if owner is not None:  # else the actor sees ``closed`` when it takes the request
            try:
                owner.tell_nowait(_FINISHED if finished else _CANCELLED)
            except ActorError:
                pass  # it ended already (a terminal error stops it)
        self._admission.leave()
