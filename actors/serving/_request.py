"""The request-stream actor: owns one request from routing to its last token.

It routes the request, streams the engine's outputs to the client, and on a *migratable* error
(worker death, drain, shutdown, a stalled or truncated stream) re-dispatches it to another worker
with the prompt plus every token generated so far, ``max_tokens``/``min_tokens`` reduced and the
same seed, up to the migration limit: the client sees one uninterrupted stream. A draining
decode worker may instead offer the request's KV (an output whose ``disaggregated_params`` name a
room on it, before the migratable error): the next decode worker then receives that KV and goes
on from the newest token with no prefill (live migration; its first output repeats that token,
which is dropped), and if that fails before its first output, the same migration falls back to
token replay. A client cancel aborts the engine request and is never migrated. Each output must
arrive within the stall timeout and the whole request within its deadline, so no request hangs
after a worker was chosen.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

import anyio
import attrs
import msgspec
import structlog
from prometheus_client import Counter, Histogram

from actors import Actor, ActorError, ActorRef, ExitReason
from actors.serving._router import Route, Routed
from actors.serving._routing import RoutingTable
from actors.telemetry import REGISTRY
from protocols import control
from protocols.engine import (
    BootstrapInfo,
    EngineOutput,
    PreprocessedRequest,
    StopConditions,
    Usage,
)
from protocols.errors import (
    EngineFailure,
    KVTransferError,
    MigrationExhausted,
    NoWorkerAvailable,
    RequestError,
    RequestTimeout,
    StreamIncomplete,
    StreamStalled,
)

__all__ = ["MIGRATIONS", "RequestStream", "StreamOptions"]

_log = structlog.get_logger("actorserve.request")

MIGRATIONS = Counter(
    "actorserve_migration",
    "Requests re-dispatched to another worker.",
    ["model", "type"],
    registry=REGISTRY,
)
MIGRATION_SECONDS = Histogram(
    "actorserve_migration_duration_seconds",
    "From the failure to the first output of the new worker (or the terminal error).",
    ["model", "type", "outcome"],
    registry=REGISTRY,
)
FALLBACKS = Counter(
    "actorserve_decode_only_fallback",
    "Disaggregated requests served by a decode worker alone (no prefill worker routable).",
    ["model"],
    registry=REGISTRY,
)
LIVE_MIGRATIONS = Counter(
    "actorserve_live_migration",
    "Requests a draining decode worker handed over with their KV: continued on the new worker "
    "(success) or replayed from their tokens instead (fallback).",
    ["model", "outcome"],
    registry=REGISTRY,
)
CANCELLATIONS = Counter(
    "actorserve_cancellation", "Requests cancelled by their client.", ["model"], registry=REGISTRY
)


@attrs.frozen
class StreamOptions:
    model: str = "model"
    disaggregated: bool = False
    migration_limit: int = 3
    stall_timeout: float = 30.0  # longest gap between two outputs
    request_timeout: float = 600.0  # the whole request
    buffer: int = 16


class RequestStream(Actor):
    """One per request, a temporary child of the model's ``streams`` supervisor."""

    reply_errors = (RequestError,)

    def __init__(
        self, router: ActorRef[Any], options: StreamOptions, table: RoutingTable | None = None
    ) -> None:
        self.router = router
        self.options = options
        self.table = table
        # A draining worker's offer of this request's KV, until an attempt took it (or it is
        # given back: on every other way out, the worker is told to free it).
        self._live: _Handover | None = None

    async def receive_stream(self, message: Any) -> AsyncIterator[EngineOutput]:
        if not isinstance(message, PreprocessedRequest):
            raise TypeError(f"expected a PreprocessedRequest, got {type(message).__name__}")
        try:
            async with aclosing(self._serve(message)) as outputs:
                async for output in outputs:
                    yield output
        except anyio.get_cancelled_exc_class():
            CANCELLATIONS.labels(self.options.model).inc()
            raise
        except GeneratorExit:
            CANCELLATIONS.labels(self.options.model).inc()
            raise
        finally:
            if self._live is not None:
                self._release(self._live)
            self.stop(ExitReason.normal())

    async def _serve(self, original: PreprocessedRequest) -> AsyncGenerator[EngineOutput, None]:
        opts = self.options
        deadline = time.monotonic() + opts.request_timeout
        generated: list[int] = []
        excluded: list[str] = []
        migrations_left = opts.migration_limit
        failed_at: float | None = None
        migration_type = "new_request"
        request = original
        while True:
            routed: Routed | None = None
            offer: _Handover | None = None
            try:
                if self._live is not None:  # continue from the handed-over KV
                    routed = await self.router.ask(Route(request, tuple(excluded), role="decode"))
                elif opts.disaggregated:
                    routed, request = await self._dispatch_prefill(
                        request, tuple(excluded), deadline
                    )
                else:
                    routed = await self._route(
                        Route(request, tuple(excluded)), deadline, retrying=failed_at is not None
                    )
                async with aclosing(self._attempt(routed, request, deadline)) as outputs:
                    async for output in outputs:
                        if failed_at is not None:
                            MIGRATION_SECONDS.labels(opts.model, migration_type, "success").observe(
                                time.monotonic() - failed_at
                            )
                            failed_at = None
                        if self._live is not None:
                            output = _drop_repeated(output, generated)
                            LIVE_MIGRATIONS.labels(opts.model, "success").inc()
                            self._live = None
                        if output.disaggregated_params is not None and not output.finished:
                            # A draining decode worker: where this request's KV waits for us.
                            offer = _Handover(routed, request.rid, output.disaggregated_params)
                            output = msgspec.structs.replace(output, disaggregated_params=None)
                        generated.extend(output.token_ids)
                        if output.finish_reason is not None:
                            yield _final(output, original, generated)
                            return
                        if output.token_ids:
                            yield output
                raise StreamIncomplete("the engine stream ended without a finish reason")
            except (RequestError, ActorError) as exc:
                error = _typed(exc)
                if self._live is not None:
                    # The live migration failed before its first output (no room, transfer
                    # failed, ...): the same migration goes on as a token replay.
                    LIVE_MIGRATIONS.labels(opts.model, "fallback").inc()
                    _log.info("live migration failed", rid=original.rid, error=error.code)
                    self._release(self._live)
                    self._live = None
                    request = _continuation(original, generated, f"{request.rid}r")
                    continue
                if offer is not None and generated:
                    self._live = offer
                elif offer is not None:
                    self._release(offer)
                if not error.migratable:
                    raise error from None
                refusal = _refuse_migration(original)
                if refusal or migrations_left <= 0:
                    if failed_at is not None:
                        MIGRATION_SECONDS.labels(opts.model, migration_type, "failure").observe(
                            time.monotonic() - failed_at
                        )
                    if refusal:
                        _log.info("migration refused", rid=original.rid, reason=refusal)
                        raise error from None
                    raise MigrationExhausted(f"{error.code}: {error.message}") from None
                migrations_left -= 1
                migration_type = "ongoing_request" if generated else "new_request"
                MIGRATIONS.labels(opts.model, migration_type).inc()
                failed_at = time.monotonic()
                if routed is not None and not isinstance(error, KVTransferError):
                    # A transfer failure may be the prefill side's fault: keep the decode worker.
                    # Only the worker that just failed: one left earlier may be serving again
                    # (a rolling release hands a request over twice); the routing view already
                    # skips workers that are dead, draining or unhealthy.
                    excluded = [routed.worker_id]
                _log.info(
                    "migrating request",
                    rid=original.rid,
                    worker=routed.worker_id if routed else None,
                    error=error.code,
                    generated=len(generated),
                )
                rid = f"{original.rid}-m{opts.migration_limit - migrations_left}"
                if self._live is not None:
                    request = _continuation(original, generated[:-1], rid, self._live.bootstrap)
                else:
                    request = _continuation(original, generated, rid)

    async def _route(self, route: Route, deadline: float, *, retrying: bool) -> Routed:
        """Ask the router; while migrating, wait (within the deadline) for a worker of the role to
        become routable again rather than fail: a single worker may be restarting."""
        while True:
            try:
                routed: Routed = await self.router.ask(route)
                return routed
            except NoWorkerAvailable:
                left = deadline - time.monotonic()
                if not retrying or self.table is None or left <= 0:
                    raise
                with anyio.move_on_after(min(left, self.options.stall_timeout)) as scope:
                    await self.table.wait_routable(1, route.role)
                if scope.cancelled_caught:
                    raise
                # Whatever is routable now may take it, the excluded worker too (restarted, it
                # is a new engine): else a lone worker's exclusion spins here until the deadline.
                route = attrs.evolve(route, exclude=())

    async def _dispatch_prefill(
        self, request: PreprocessedRequest, exclude: tuple[str, ...], deadline: float
    ) -> tuple[Routed, PreprocessedRequest]:
        """Disaggregated: pick a prefill and a decode worker, start the prefill with a fresh room
        and return the decode side's routing and request (decode starts concurrently, as in
        SGLang's bootstrap protocol). With no prefill worker routable, decode serves the request
        alone (Dynamo's decode-only fallback)."""
        decode = await self._route(Route(request, exclude, role="decode"), deadline, retrying=True)
        try:
            prefill = await self.router.ask(Route(request, role="prefill"))
        except NoWorkerAvailable:
            FALLBACKS.labels(self.options.model).inc()
            return decode, msgspec.structs.replace(request, bootstrap_info=None)
        except BaseException:
            self._done(decode)
            raise
        if prefill.bootstrap is None:
            self._done(prefill)
            self._done(decode)
            raise EngineFailure(f"prefill worker {prefill.worker_id} has no bootstrap endpoint")
        boot = msgspec.structs.replace(prefill.bootstrap, room=secrets.randbits(63))
        stop = msgspec.structs.replace(request.stop_conditions, max_tokens=1, min_tokens=None)
        prefill_request = msgspec.structs.replace(
            request, bootstrap_info=boot, stop_conditions=stop
        )
        self.start_soon(self._prefill, prefill, prefill_request, name=f"prefill {request.rid}")
        return decode, msgspec.structs.replace(request, bootstrap_info=boot)

    async def _prefill(self, routed: Routed, request: PreprocessedRequest) -> None:
        """Drain the prefill stream: it ends when the KV transfer reached a terminal state. A
        failure here surfaces on the decode side as a (migratable) KV transfer error."""
        try:
            async with routed.engine.stream(request, buffer=4) as outputs:
                async for _ in outputs:
                    pass
        except (RequestError, ActorError) as exc:
            _log.info("prefill failed", rid=request.rid, worker=routed.worker_id, error=str(exc))
        finally:
            self._done(routed)

    async def _attempt(
        self, routed: Routed, request: PreprocessedRequest, deadline: float
    ) -> AsyncGenerator[EngineOutput, None]:
        opts = self.options
        async with routed.engine.stream(request, buffer=opts.buffer) as outputs:
            try:
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise RequestTimeout(f"request exceeded {opts.request_timeout} s")
                    # A timed receive, not a cancel scope per output (that cost a third of an
                    # output's trip through this actor).
                    try:
                        output = await outputs.receive(min(opts.stall_timeout, left))
                    except StopAsyncIteration:
                        return
                    except TimeoutError:
                        if left <= opts.stall_timeout:
                            raise RequestTimeout(
                                f"request exceeded {opts.request_timeout} s"
                            ) from None
                        raise StreamStalled(
                            f"no output for {opts.stall_timeout} s from {routed.worker_id}"
                        ) from None
                    yield output
            finally:
                self._done(routed)

    def _release(self, offer: _Handover) -> None:
        """Tell the draining worker to free the KV it kept for us (once its room is terminal;
        a no-op if the new worker already took it). Fire and forget."""
        try:
            offer.source.engine.tell_nowait(control.Abort(offer.rid))
        except ActorError:
            pass

    def _done(self, routed: Routed) -> None:
        # Fire and forget: this runs while a cancellation may be unwinding us.
        try:
            self.router.tell_nowait(routed.done())
        except ActorError:
            pass


def _typed(exc: BaseException) -> RequestError:
    if isinstance(exc, RequestError):
        return exc
    # The engine actor died, is restarting or went away: a failure of the worker.
    return EngineFailure(str(exc))


def _refuse_migration(request: PreprocessedRequest) -> str | None:
    if request.sampling_options.n > 1:
        return "n > 1: per-choice state cannot be carried over"
    if request.sampling_options.guided_decoding:
        return "guided decoding: the grammar state would restart"
    return None


@attrs.frozen
class _Handover:
    """A draining decode worker's offer: request ``rid``'s KV, readable at ``bootstrap``."""

    source: Routed
    rid: str
    bootstrap: BootstrapInfo


def _drop_repeated(output: EngineOutput, generated: list[int]) -> EngineOutput:
    """A live migration's first output, less the token it repeats (the newest before the hand-
    over: its KV was not handed over, so the new worker computes it again)."""
    if not output.token_ids or output.token_ids[0] != generated[-1]:
        raise KVTransferError("the live-migrated request did not resume where it stopped")
    return msgspec.structs.replace(output, token_ids=output.token_ids[1:])


def _continuation(
    original: PreprocessedRequest,
    generated: list[int],
    rid: str,
    live: BootstrapInfo | None = None,
) -> PreprocessedRequest:
    """The request that continues ``original`` after ``generated`` tokens elsewhere; with
    ``live``, from the KV of ``original`` plus ``generated`` handed over at that room.

    Each attempt gets its own engine request id ``rid``: a migration may land on the same
    worker while the aborted attempt is still being torn down there."""
    stop = original.stop_conditions
    done = len(generated)
    conditions = StopConditions(
        max_tokens=None if stop.max_tokens is None else max(0, stop.max_tokens - done),
        min_tokens=None if stop.min_tokens is None else max(0, stop.min_tokens - done),
        stop=stop.stop,
        stop_token_ids=stop.stop_token_ids,
        ignore_eos=stop.ignore_eos,
    )
    return msgspec.structs.replace(
        original,
        rid=rid,
        token_ids=[*original.token_ids, *generated],
        stop_conditions=conditions,
        bootstrap_info=live,
        live_migration=live is not None,
    )


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
