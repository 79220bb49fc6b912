"""The request-stream actor: owns one request from routing to its last token.

It routes the request, opens the engine's stream for the client, and on a *migratable* error
(worker death, drain, shutdown, a stalled or truncated stream, a block-diffusion model's output
with no block: ``StreamOptions.kind``) re-dispatches it to another worker with the prompt plus
every token generated so far, ``max_tokens``/``min_tokens`` reduced and the same seed, up to the
migration limit: the client sees one uninterrupted stream. A draining
decode worker may instead offer the request's KV (an output whose ``disaggregated_params`` name a
room on it, before the migratable error): the next decode worker then receives that KV and goes
on from the newest token with no prefill (live migration; its first output repeats that token,
which is dropped), and if that fails before its first output, the same migration falls back to
token replay. An offer that says how far the KV goes (``handover_tokens``: a drain offers as it
begins, a step before the error) has its continuation sent to the next worker at once, so that
worker is ready when the error comes (:class:`Prepare`). A client cancel aborts the engine
request and is never migrated. Each output must arrive within the stall timeout and the whole
request within its deadline, so no request hangs after a worker was chosen.

The actor decides each attempt (route, migrate, hand over, give up); the outputs of an attempt
go to the client in the client's own task (``_outputs.py``, ``_attempt.py``), not through this
actor's.
"""

from __future__ import annotations

import functools
import secrets
import time
from typing import Any

import anyio
import attrs
import msgspec
import structlog

from actors import Actor, ActorError, ReplyError, ReplyStream
from actors.serving.requests._attempt import Attempt, Handover, Prepare, Progress
from actors.serving.requests._continuation import continuation
from actors.serving.requests._local_prefill import LocalPrefill
from actors.serving.requests._metrics import (
    CANCELLATIONS,
    FALLBACKS,
    LIVE_MIGRATIONS,
    LIVE_MIGRATIONS_AHEAD,
    MIGRATION_SECONDS,
    MIGRATIONS,
)
from actors.serving.requests._outputs import Finish, NextAttempt, RequestOutputs
from actors.serving.requests._prefill import Prefill, PrefillFirstAttempt
from actors.serving.requests._trace import AttemptTrace, RequestTrace, end_span
from actors.serving.routing import Policy, Role, Routed, RoutingTable
from actors.tracing import tracer
from protocols import control
from protocols.engine import EngineOutput, ModelKind, PreprocessedRequest
from protocols.errors import (
    EngineFailure,
    KVTransferError,
    MigrationExhausted,
    NoWorkerAvailable,
    RequestError,
    RequestTimeout,
    WorkerDraining,
)

__all__ = ["MIGRATIONS", "RequestStream", "StreamOptions"]

_log = structlog.get_logger("actorserve.request")


@attrs.frozen
class StreamOptions:
    model: str = "model"
    disaggregated: bool = False
    migration_limit: int = 3
    stall_timeout: float = 30.0  # longest gap between two outputs
    request_timeout: float = 600.0  # the whole request
    router: Policy = "kv_aware"  # how workers are picked (the --router policy)
    # Outputs an engine may send ahead of the client (its credit window). The root returns
    # credit per half window, a send that also wakes the engine's process: with 32, one per
    # 16 outputs instead of per 8.
    buffer: int = 32
    # What the model serves: a block-diffusion model's (dllm) empty output is an error.
    kind: ModelKind = "chat"
    # When a disaggregated request's decode worker prefills it itself.
    local_prefill: LocalPrefill = attrs.field(factory=LocalPrefill)


class RequestStream(Actor):
    """One per request, a temporary child of the model's ``streams`` supervisor, started with
    the request's first :class:`NextAttempt` in its mailbox.

    Its consumer reads the request through :class:`~actors.serving.RequestOutputs` (it asks
    :class:`NextAttempt` for the first attempt and after each failed one, and tells
    :class:`Finish`); a draining worker's offer comes as :class:`Prepare`.
    """

    reply_errors = (RequestError,)

    def __init__(self, table: RoutingTable, options: StreamOptions) -> None:
        self.table = table
        self.options = options
        self._progress: Progress | None = None
        self._attempt: Attempt | None = None  # the one being read: its routing slot is ours
        # The continuation a draining worker's offer was sent on ahead (see Prepare), with
        # that offer, until the attempt that made it ends.
        self._prepared: tuple[Handover, Attempt] | None = None
        self._excluded: tuple[str, ...] = ()
        self._migrations_left = options.migration_limit
        self._ended = False

    async def receive(self, message: Any) -> Any:
        match message:
            case NextAttempt(failed=None, outputs=outputs):
                self._own(outputs)
                return await self._next(None, None)
            case NextAttempt(failed=failed, error=error):
                return await self._next(failed, error)
            case Finish(cancelled=cancelled):
                self._finish(cancelled)
                return None
            case Prepare(offer=offer, generated=generated):
                self._prepare(offer, generated)
                return None
            case _:
                return await super().receive(message)

    def _own(self, outputs: RequestOutputs) -> None:
        """Take the request ``outputs`` reads (the first message: it started this actor)."""
        if self._progress is not None:
            raise ReplyError("a request stream serves one request")
        outputs.owner = self.ref  # from now on its consumer tells us when it gives up
        # Every line this actor's task logs is about this request: each carries its ids.
        structlog.contextvars.bind_contextvars(
            **{**outputs.log_context, "rid": outputs.request.rid}
        )
        deadline = outputs.deadline = time.monotonic() + self.options.request_timeout
        self._progress = Progress(outputs.request, deadline, self._trace(outputs))
        if outputs.closed:  # it gave up before we ran
            self._finish(cancelled=True)
            raise ReplyError("the request was cancelled before it started")

    def _trace(self, outputs: RequestOutputs) -> RequestTrace | None:
        """The request's span, while tracing is on (from its admission, under the client's)."""
        start, active = outputs.trace_start, tracer()
        if start is None or active is None:
            return None
        request_id = outputs.log_context.get("request_id")
        return RequestTrace(
            active,
            *start,
            outputs.request,
            model=self.options.model,
            request_id=request_id if isinstance(request_id, str) else None,
        )

    def _finish(self, cancelled: bool, error: RequestError | None = None) -> None:
        """The request is over (``error`` ended it): free what it holds, then stop."""
        if self._ended:
            return
        self._ended = True
        if cancelled:
            CANCELLATIONS.labels(self.options.model).inc()
        self._end_attempt()
        progress = self._progress
        if progress is not None and progress.live is not None:
            self._release(progress.live)
            progress.live = None
        prepared, self._prepared = self._prepared, None
        if prepared is not None:
            self._drop(prepared[1])
            self._release(prepared[0])
        if progress is not None and progress.trace is not None:
            progress.trace.end(error, cancelled=cancelled)
        self.stop()

    def _end_attempt(self) -> None:
        attempt, self._attempt = self._attempt, None
        if attempt is not None:
            self._close(attempt)

    def _close(self, attempt: Attempt) -> None:
        attempt.outputs.close()  # a no-op if it ended (or its consumer closed it)
        if isinstance(attempt, PrefillFirstAttempt):
            attempt.release_prefill()  # unread: drained by its task
        self._done(attempt.routed)
        self._end_trace(attempt, None)

    def _end_trace(self, attempt: Attempt, error: BaseException | None) -> None:
        """End ``attempt``'s span (once: the first end says how it ended)."""
        trace, attempt.trace = attempt.trace, None
        if trace is not None:
            trace.end(error)

    def _attempt_trace(
        self, request: PreprocessedRequest, *, prepared: bool = False
    ) -> tuple[AttemptTrace | None, PreprocessedRequest]:
        """A new attempt's span while tracing, and ``request`` carrying it to the engine."""
        progress = self._progress
        assert progress is not None
        if progress.trace is None:
            return None, request
        trace = progress.trace.attempt(request, prepared=prepared)
        return trace, trace.carry(request)

    def _prepare(self, offer: Handover, generated: list[int]) -> None:
        """Send the continuation from ``offer``'s KV to the next decode worker now: it admits
        the request and asks for the KV while the draining worker's last step runs, and the
        migration the offering attempt's end asks for takes it (:meth:`_ready`). Where that
        cannot be done now, the migration does it then."""
        progress = self._progress
        if self._ended or progress is None or self._prepared is not None:
            return
        original = progress.original
        if self._migrations_left <= 0:
            return
        n = self.options.migration_limit - self._migrations_left + 1
        request = continuation(original, generated, f"{original.rid}-m{n}", offer.bootstrap)
        try:
            routed = self._take("decode", request, (offer.source.worker_id,))
        except NoWorkerAvailable:
            return
        trace, request = self._attempt_trace(routed.placed(request), prepared=True)
        if trace is not None:
            trace.routed(routed.worker_id, self._role())
        try:
            outputs = routed.engine.stream(request, buffer=self.options.buffer)
        except ActorError as exc:
            if trace is not None:
                trace.end(exc)
            self._done(routed)
            return
        self._prepared = (offer, self._new_attempt(routed, request, outputs, None, trace))

    def _ready(self, request: PreprocessedRequest) -> Attempt | None:
        """The prepared attempt, if it is the live migration ``request`` (else it is closed)."""
        prepared, self._prepared = self._prepared, None
        if prepared is None:
            return None
        offer, attempt = prepared
        progress = self._progress
        assert progress is not None
        if progress.live is offer and request.token_ids == attempt.request.token_ids:
            LIVE_MIGRATIONS_AHEAD.labels(self.options.model, "taken").inc()
            return attempt
        self._drop(attempt)
        return None

    def _drop(self, prepared: Attempt) -> None:
        LIVE_MIGRATIONS_AHEAD.labels(self.options.model, "dropped").inc()
        self._close(prepared)

    async def _next(self, failed: Attempt | None, exc: BaseException | None) -> Attempt:
        """The next attempt: the first (``failed`` is None), or a migration after ``failed``
        ended with ``exc``. Raises the request's terminal error, and stops, if there is none."""
        progress = self._progress
        assert progress is not None and not self._ended
        error = None if exc is None else _typed(exc)
        if failed is not None:
            self._end_trace(failed, error)
        self._end_attempt()
        routed = failed.routed if failed is not None else None
        offer = failed.offer if failed is not None else None
        request = failed.request if failed is not None else progress.original
        try:
            while True:
                if error is not None:
                    request = self._migration(error, routed, offer, request)
                    ready = self._ready(request)
                    if ready is not None:
                        self._attempt = ready
                        return ready
                routed = offer = prefill = None
                trace, request = self._attempt_trace(request)
                try:
                    routed, request, prefill = await self._route_request(request, trace)
                    request = routed.placed(request)  # on the data-parallel rank it was routed to
                    if trace is not None:
                        trace.routed(routed.worker_id, self._role())
                    outputs = routed.engine.stream(request, buffer=self.options.buffer)
                except (RequestError, ActorError) as route_exc:
                    if routed is not None:
                        self._done(routed)
                    if prefill is not None:
                        self._drain(prefill, request.rid, read=True)
                    error = _typed(route_exc)
                    if trace is not None:
                        trace.end(error)
                    continue
                if prefill is not None:
                    # After both sends: starting a task is the costliest step here.
                    self._drain(prefill, request.rid, read=request.stop_conditions.max_tokens == 0)
                    if prefill.read.is_set():
                        prefill = None
                attempt = self._attempt = self._new_attempt(
                    routed, request, outputs, prefill, trace
                )
                return attempt
        except RequestError as terminal:
            self._finish(cancelled=False, error=terminal)
            raise

    def _new_attempt(
        self,
        routed: Routed,
        request: PreprocessedRequest,
        outputs: ReplyStream[EngineOutput],
        prefill: Prefill | None,
        trace: AttemptTrace | None,
    ) -> Attempt:
        progress = self._progress
        assert progress is not None
        opts = self.options
        kind = (
            Attempt if prefill is None else functools.partial(PrefillFirstAttempt, prefill=prefill)
        )
        return kind(
            routed,
            request,
            outputs,
            progress,
            model=opts.model,
            stall_timeout=opts.stall_timeout,
            request_timeout=opts.request_timeout,
            owner=self.ref,
            kind=opts.kind,
            trace=trace,
        )

    def _role(self) -> Role:
        """The role of the worker an attempt streams from."""
        return "decode" if self.options.disaggregated else "aggregated"

    def _migration(
        self,
        error: RequestError,
        routed: Routed | None,
        offer: Handover | None,
        request: PreprocessedRequest,
    ) -> PreprocessedRequest:
        """After ``error``, the request the next attempt sends (a continuation), or raise the
        terminal error."""
        progress = self._progress
        assert progress is not None
        opts = self.options
        original, generated = progress.original, progress.generated
        if progress.live is not None:
            # The live migration failed before its first output (no room, transfer failed,
            # ...): the same migration goes on as a token replay.
            LIVE_MIGRATIONS.labels(opts.model, "fallback").inc()
            _log.info("live migration failed", error=error.code)
            if progress.trace is not None:
                progress.trace.fallback(error)
            self._release(progress.live)
            progress.live = None
            return continuation(original, generated, f"{request.rid}r")
        if offer is not None and generated and isinstance(error, WorkerDraining):
            progress.live = offer
        elif offer is not None:
            # Not the drain's hand-over (the worker failed, or its stream broke): its KV may
            # never come.
            self._release(offer)
        if not error.migratable:
            raise error from None
        if self._migrations_left <= 0:
            if progress.failed_at is not None:
                MIGRATION_SECONDS.labels(opts.model, progress.migration_type, "failure").observe(
                    time.monotonic() - progress.failed_at
                )
            raise MigrationExhausted(f"{error.code}: {error.message}") from None
        self._migrations_left -= 1
        progress.migration_type = "ongoing_request" if generated else "new_request"
        MIGRATIONS.labels(opts.model, progress.migration_type).inc()
        progress.failed_at = time.monotonic()
        if routed is not None and not isinstance(error, KVTransferError):
            # A transfer failure may be the prefill side's fault: keep the decode worker. Only
            # the worker that just failed: one left earlier may be serving again (a rolling
            # release hands a request over twice); the routing view already skips workers that
            # are dead, draining or unhealthy.
            self._excluded = (routed.worker_id,)
        worker = routed.worker_id if routed else None
        _log.info("migrating request", worker=worker, error=error.code, generated=len(generated))
        if progress.trace is not None:
            live = progress.live is not None
            progress.trace.migration(error, worker, len(generated), live=live)
        rid = f"{original.rid}-m{opts.migration_limit - self._migrations_left}"
        if progress.live is not None:
            return continuation(original, generated[:-1], rid, progress.live.bootstrap)
        return continuation(original, generated, rid)

    async def _route_request(
        self, request: PreprocessedRequest, trace: AttemptTrace | None
    ) -> tuple[Routed, PreprocessedRequest, Prefill | None]:
        """The worker for the next attempt, the request to send it and, disaggregated, the
        prefill whose first output is the client's first token (sent already, under
        ``trace``)."""
        progress = self._progress
        assert progress is not None
        if progress.live is not None:  # continue from the handed-over KV
            return self._take("decode", request, self._excluded), request, None
        retrying = progress.failed_at is not None
        if self.options.disaggregated:
            return await self._dispatch_prefill(
                request, progress.deadline, retrying=retrying, trace=trace
            )
        routed = await self._route("aggregated", request, progress.deadline, retrying=retrying)
        return routed, request, None

    def _take(self, role: Role, request: PreprocessedRequest, exclude: tuple[str, ...]) -> Routed:
        """Route here, from the routing view (it lives on this event loop: no hop to another
        actor; ``RoutingTable.take`` counts the request in flight there)."""
        return self.table.take(role, self.options.router, request.token_ids, exclude)

    async def _route(
        self, role: Role, request: PreprocessedRequest, deadline: float, *, retrying: bool
    ) -> Routed:
        """Route; while migrating, wait up to the request's deadline for a worker of the role
        to become routable again rather than fail: a worker, or its whole pool, may be
        restarting. A new request fails at once (its client is told to retry later)."""
        exclude = self._excluded
        while True:
            try:
                return self._take(role, request, exclude)
            except NoWorkerAvailable:
                if not retrying:
                    raise
                with anyio.move_on_after(deadline - time.monotonic()) as scope:
                    await self.table.wait_routable(1, role)
                if scope.cancelled_caught:
                    raise RequestTimeout(
                        f"no {role} worker came back before the deadline"
                    ) from None
                # Whatever is routable now may take it, the excluded worker too (restarted, it
                # is a new engine): else a lone worker's exclusion spins here until the deadline.
                exclude = ()

    async def _dispatch_prefill(
        self,
        request: PreprocessedRequest,
        deadline: float,
        *,
        retrying: bool,
        trace: AttemptTrace | None,
    ) -> tuple[Routed, PreprocessedRequest, Prefill | None]:
        """Disaggregated: pick a decode and a prefill worker, send the prefill its request with a
        fresh room and return the decode side's routing and request (sent by the caller at once:
        both start together, as in SGLang's bootstrap protocol), with the prefill if its first
        token is the client's. Decode prefills the request itself instead where its engine can
        and the options' :class:`LocalPrefill` says so (conditional disaggregation), or with no
        prefill worker routable (Dynamo's decode-only fallback); an engine that cannot waits for
        a prefill worker as it would for a decode worker."""
        decode = await self._route("decode", request, deadline, retrying=retrying)
        decision = self.options.local_prefill.decide(self.table, decode, request.token_ids)
        routed: Routed | None = None
        if not decision.local:
            try:
                routed = self._take("prefill", request, ())
            except NoWorkerAvailable:
                if decode.prefills_alone:
                    FALLBACKS.labels(self.options.model).inc()
                    decision = attrs.evolve(decision, reason="no_prefill_worker")
                else:
                    self._done(decode)
                    routed = await self._route("prefill", request, deadline, retrying=retrying)
                    try:
                        decode = await self._route("decode", request, deadline, retrying=retrying)
                    except BaseException:
                        self._done(routed)
                        raise
        decision.record(self.options.model, request.rid)
        if routed is None:
            return decode, msgspec.structs.replace(request, bootstrap_info=None), None
        if routed.bootstrap is None:
            self._done(routed)
            self._done(decode)
            raise EngineFailure(f"prefill worker {routed.worker_id} has no bootstrap endpoint")
        boot = msgspec.structs.replace(routed.bootstrap, room=secrets.randbits(63))
        stop = request.stop_conditions
        # One step. The first token is sampled as decode would (no end of sequence where
        # min_tokens forbids it): it may be the client's.
        min_tokens = 1 if stop.min_tokens else None
        prefill_stop = msgspec.structs.replace(stop, max_tokens=1, min_tokens=min_tokens)
        prefill_request = msgspec.structs.replace(
            request, bootstrap_info=boot, stop_conditions=prefill_stop
        )
        decode_request = msgspec.structs.replace(request, bootstrap_info=boot)
        span = None
        if trace is not None:
            span, prefill_request = trace.prefill(routed.worker_id, prefill_request)
        try:
            # Sent here, not from the task below: the prefill (the first step of the client's
            # time to first token) goes out with the decode request, a task switch sooner.
            outputs = routed.engine.stream(prefill_request, buffer=4)
        except ActorError as exc:  # on the decode side, a (migratable) KV transfer error
            _log.info(
                "prefill failed", attempt=request.rid, worker=routed.worker_id, error=str(exc)
            )
            if span is not None:
                end_span(span, exc)
            self._done(routed)
            return decode, decode_request, None
        return decode, decode_request, Prefill(routed, outputs, span)

    def _drain(self, prefill: Prefill, rid: str, *, read: bool) -> None:
        """Start draining ``prefill`` (once its consumer read it, unless ``read``: it never
        will; a token past the client's ``max_tokens`` never is the client's)."""
        if read:
            prefill.read.set()
        self.start_soon(self._prefill, prefill, rid, name=f"prefill {rid}")

    async def _prefill(self, prefill: Prefill, rid: str) -> None:
        """Drain the prefill stream once its consumer read what it wanted of it: it ends when the
        KV transfer reached a terminal state. A failure here surfaces on the decode side as a
        (migratable) KV transfer error."""
        routed = prefill.routed
        error: BaseException | None = None
        try:
            async with prefill.outputs as outputs:
                await prefill.read.wait()
                async for _ in outputs:
                    pass
        except (RequestError, ActorError) as exc:
            error = exc
            _log.info("prefill failed", attempt=rid, worker=routed.worker_id, error=str(exc))
        finally:
            self._done(routed)
            if prefill.span is not None:
                end_span(prefill.span, error)

    def _release(self, offer: Handover) -> None:
        """Tell the draining worker to free the KV it kept for us (once its room is terminal;
        a no-op if the new worker already took it). Fire and forget."""
        try:
            offer.source.engine.tell_nowait(control.Abort(offer.rid))
        except ActorError:
            pass

    def _done(self, routed: Routed) -> None:
        self.table.done(routed.worker_id, routed.dp_rank)


def _typed(exc: BaseException) -> RequestError:
    if isinstance(exc, RequestError):
        return exc
    # The engine actor died, is restarting or went away: a failure of the worker.
    return EngineFailure(str(exc))
