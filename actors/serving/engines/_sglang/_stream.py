"""One request's stream through SGLang, and its ordered abort.

Submitting our own rid lets an abort find the request before its first token. The abort follows
Dynamo's newest cancellation (``cancellation.py``): wait (bounded) for the rid to appear in the
tokenizer manager's ``rid_to_state``, wait briefly for it to be dispatched to the scheduler, then
``abort_request`` and keep reading the stream for a bounded time so the abort finishes cleanly,
retrying the abort a few times where SGLang may drop it. One improvement: a request that never
reached the scheduler (SGLang is paused, or still tokenizing) is not aborted but *interrupted*:
the step that runs SGLang's generator is cancelled, and SGLang drops the undelivered request
locally (an abort sent for it would be lost in the tokenizer-to-scheduler gap).

The first step of SGLang's generator runs in its own task so that it can be cancelled precisely
while the request is not yet dispatched, and so that a prefill request is registered in SGLang
(its bootstrap room with it) before the bootstrap triple is handed out. Later steps run inline.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import anyio

from actors.serving.engines._sglang._config import Role, sampling_params
from protocols.engine import (
    BootstrapInfo,
    EngineOutput,
    PauseMode,
    PreprocessedRequest,
    TokenLogprob,
    Usage,
    normalize_finish_reason,
)
from protocols.errors import (
    EngineFailure,
    EngineShutdown,
    InvalidRequest,
    RequestError,
    StreamIncomplete,
    WorkerDraining,
)

__all__ = [
    "RequestStream",
    "StreamConfig",
    "prompt_logprobs",
    "stopped_error",
    "worker_abort_error",
]

REGISTRATION_WAIT_S = 30.0  # Dynamo: wait for the rid to register
DISPATCH_WAIT_S = 0.25  # Dynamo: then for the dispatch to the scheduler
DRAIN_S = 1.0  # Dynamo: read the stream this long after an abort
ABORT_RETRIES = 8  # Dynamo: 50 ms doubling to 1 s
CLOSE_TIMEOUT_S = 5.0  # closing an abandoned stream never waits longer than this
_POLL_MAX_S = 0.05


@dataclass(frozen=True)
class StreamConfig:
    """What every request stream of one engine shares."""

    role: Role
    bootstrap_host: str
    bootstrap_port: int | None
    dp_param: str | None  # "routed_dp_rank" (newer SGLang) or "data_parallel_rank"
    supports_priority: bool
    retry_aborts: bool
    # What this SGLang raises for a request an abort flagged before its dispatch (SGLang <= 0.5.17
    # has RequestAbortedError, a ValueError; newer versions have none).
    aborted_errors: tuple[type[Exception], ...] = ()
    # A block-diffusion model (``dllm_algorithm``) sends every chunk it makes: one without tokens
    # is a fault the request stream migrates, not a step to skip.
    forward_empty: bool = False
    # Whether async_generate takes a W3C trace context (``external_trace_header``): a request
    # the root traces continues its trace in SGLang's own spans (with its ``enable_trace``).
    trace_header: bool = False


class _Owner(Protocol):
    @property
    def closing(self) -> bool: ...

    @property
    def paused(self) -> PauseMode | None: ...


class _End:
    """The stream ended (StopAsyncIteration)."""


class _Stopped:
    """The step was interrupted, or the drain after an abort ran out."""


_END = _End()
_STOPPED = _Stopped()


def worker_abort_error(owner: _Owner, message: str, reason: Any, *, shutdown: bool) -> RequestError:
    """The error for an abort of a request (generation or embedding) the client did not ask for,
    never reported as "cancelled": the engine shut down (``shutdown``: this request's stream
    saw it), draining (paused), a 4xx status in SGLang's ``reason``, else a failure."""
    status = reason.get("status_code") if isinstance(reason, Mapping) else None
    if shutdown or owner.closing:
        return EngineShutdown("the SGLang engine shut down while the request ran")
    if owner.paused is not None:
        return WorkerDraining("generation paused: SGLang aborted the request")
    if isinstance(status, int) and 400 <= status < 500:
        return InvalidRequest(message or f"SGLang rejected the request ({status})")
    return EngineFailure(message or "SGLang aborted the request")


def stopped_error(owner: _Owner, what: str, *, shutdown: bool) -> RequestError:
    """The error for a request (its ``what``) stopped without the client's abort: the engine
    shut down (``shutdown``: this request's stream saw it), else a failure."""
    if shutdown or owner.closing:
        return EngineShutdown("the SGLang engine shut down while the request ran")
    return EngineFailure(f"the SGLang {what} was stopped")


def dispatched(state: Any) -> bool | None:
    """Whether SGLang sent the request to its scheduler; ``None`` when this SGLang cannot say."""
    flag = getattr(state, "dispatched", None)
    if isinstance(flag, bool):
        return flag
    stats = getattr(state, "time_stats", None)
    if stats is not None and hasattr(stats, "api_server_dispatch_finish_time"):
        return bool(stats.api_server_dispatch_finish_time)
    return None


def _logprobs(meta: Mapping[str, Any], n: int, top: int) -> list[TokenLogprob] | None:
    """The logprobs of a chunk's ``n`` new tokens from SGLang's ``meta_info``, whose lists of
    ``(logprob, token id, text)`` hold the whole output so far or only the new tokens (with
    incremental streaming): the last ``n`` entries either way. ``None`` when it has fewer than
    that (a token it reported no logprob for), so that no logprob goes with the wrong token.
    ``top`` alternatives at most (SGLang's one top-k may serve a larger prompt top-k too)."""
    chosen = meta.get("output_token_logprobs") or ()
    if n == 0 or len(chosen) < n:
        return None
    tops = meta.get("output_top_logprobs") or ()
    tops = tops[-n:] if len(tops) >= n else [None] * n
    return [
        TokenLogprob(
            float(entry[0]),
            [int(alt[1]) for alt in list(alts or ())[:top]],
            [float(alt[0]) for alt in list(alts or ())[:top]],
        )
        for entry, alts in zip(chosen[-n:], tops, strict=True)
    ]


def prompt_logprobs(meta: Mapping[str, Any], n_prompt: int, top: int) -> list[TokenLogprob] | None:
    """The logprobs of the prompt's tokens after the first from SGLang's ``meta_info``
    (``input_token_logprobs``: ``(logprob, token id, text)`` per prompt token, the first's
    logprob ``None``; ``input_top_logprobs``: the alternatives of each), with ``top``
    alternatives each. ``None`` when SGLang sent fewer than the prompt has (a decode worker
    that did not compute them)."""
    chosen = meta.get("input_token_logprobs") or ()
    if n_prompt < 1 or len(chosen) < n_prompt:
        return None
    chosen = chosen[len(chosen) - n_prompt + 1 :]
    tops = meta.get("input_top_logprobs") or ()
    tops = tops[len(tops) - len(chosen) :] if len(tops) >= len(chosen) else [None] * len(chosen)
    out: list[TokenLogprob] = []
    for entry, alts in zip(chosen, tops, strict=True):
        if entry[0] is None:
            return None
        alts = list(alts or ())[:top]
        out.append(
            TokenLogprob(float(entry[0]), [int(a[1]) for a in alts], [float(a[0]) for a in alts])
        )
    return out


async def _anext(gen: AsyncIterator[Any]) -> Any:
    return await gen.__anext__()


class RequestStream:
    """Drives one ``async_generate`` stream and maps SGLang chunks to :class:`EngineOutput`."""

    def __init__(
        self,
        owner: _Owner,
        engine: Any,
        tm: Any,
        request: PreprocessedRequest,
        config: StreamConfig,
    ) -> None:
        self.rid = request.rid
        self.client_aborted = False
        self._owner, self._engine, self._tm = owner, engine, tm
        self._request = request
        self._config = config
        self._prompt = len(request.token_ids)
        self._completion = 0
        self._bootstrap: BootstrapInfo | None = None
        self._gen: AsyncIterator[Any] | None = None
        self._first: asyncio.Future[Any] | None = None
        self._scope: anyio.CancelScope | None = None
        self._drain_deadline = math.inf
        self._interrupted = False
        self._shutdown = False
        self._submitted = False
        self._finished = False
        # The side that streams the tokens asks for the prompt's logprobs (a prefill worker's
        # stream carries none), and sends them with its first output.
        self._prompt_logprobs_due = request.prompt_logprobs is not None and config.role != "prefill"

    # ---------------------------------------------------------------------------- submit

    def _kwargs(self) -> dict[str, Any]:
        req, cfg = self._request, self._config
        kwargs: dict[str, Any] = {
            "input_ids": list(req.token_ids),
            "sampling_params": sampling_params(req),
            "stream": True,
            "rid": req.rid,
        }
        boot = req.bootstrap_info
        if cfg.role == "prefill":
            if boot is None:  # no router-chosen triple: this worker's endpoint, a fresh room
                assert cfg.bootstrap_port is not None
                boot = BootstrapInfo(
                    host=cfg.bootstrap_host, port=cfg.bootstrap_port, room=random.getrandbits(63)
                )
            self._bootstrap = boot
        elif cfg.role == "decode" and boot is None:
            raise InvalidRequest("a decode worker needs the request's bootstrap_info")
        if self._prompt_logprobs_due:
            # From the first prompt token on; SGLang's one top-k serves prompt and output.
            top = max(req.prompt_logprobs or 0, req.logprobs or 0)
            kwargs.update(return_logprob=True, top_logprobs_num=top, logprob_start_len=0)
        elif req.logprobs is not None:
            # Output logprobs only (-1): prompt logprobs would cost a pass over the prompt.
            kwargs.update(return_logprob=True, top_logprobs_num=req.logprobs, logprob_start_len=-1)
        if cfg.role != "aggregated" and boot is not None:
            kwargs.update(
                bootstrap_host=boot.host, bootstrap_port=boot.port, bootstrap_room=boot.room
            )
        routing = req.routing
        if routing is not None:
            if routing.dp_rank is not None and cfg.dp_param is not None:
                kwargs[cfg.dp_param] = routing.dp_rank
            if routing.priority is not None and cfg.supports_priority:
                kwargs["priority"] = routing.priority
        if req.traceparent is not None and cfg.trace_header:
            kwargs["external_trace_header"] = {"traceparent": req.traceparent}
        return kwargs

    async def run(self) -> AsyncGenerator[EngineOutput, None]:
        """The stream of outputs (a prefill's first one carries the bootstrap triple)."""
        kwargs = self._kwargs()
        try:
            gen = await self._engine.async_generate(**kwargs)
        except ValueError as exc:  # SGLang's argument validation (e.g. dp rank out of range)
            raise InvalidRequest(str(exc)) from exc
        except Exception as exc:
            raise EngineFailure(f"SGLang refused the request: {exc!r}") from exc
        self._gen = gen
        self._submitted = True
        first: asyncio.Future[Any] = asyncio.ensure_future(_anext(gen))
        self._first = first
        try:
            if self._bootstrap is not None:
                await self._wait_prefill_dispatched(first)
                if self._interrupted:
                    yield self._stopped()
                    return
                yield EngineOutput(disaggregated_params=self._bootstrap)
            chunk = await self._step(first)
            while True:
                if chunk is _END:
                    yield self._ended()
                    return
                if chunk is _STOPPED:
                    yield self._stopped()
                    return
                meta = chunk.get("meta_info") or {}
                reason = meta.get("finish_reason")
                raw = reason.get("type") if isinstance(reason, Mapping) else reason
                new = list(chunk.get("output_ids") or ())
                self._completion += len(new)
                ids = [] if self._config.role == "prefill" else new  # decode streams the tokens
                top = self._request.logprobs
                logprobs = _logprobs(meta, len(ids), top) if top is not None else None
                prompt_lp = self._take_prompt_logprobs(meta) if ids or raw is not None else None
                if raw is None:
                    if ids or (self._config.forward_empty and self._config.role != "prefill"):
                        yield EngineOutput(
                            token_ids=ids, logprobs=logprobs, prompt_logprobs=prompt_lp
                        )
                    chunk = await self._step(None)
                    continue
                self._finished = True
                usage = Usage(
                    prompt_tokens=int(meta.get("prompt_tokens", self._prompt)),
                    completion_tokens=int(meta.get("completion_tokens", self._completion)),
                    cached_tokens=meta.get("cached_tokens"),
                )
                if str(raw).startswith("abort") and not self.client_aborted:
                    if ids:  # never lose tokens the client has not seen
                        yield EngineOutput(
                            token_ids=ids, logprobs=logprobs, prompt_logprobs=prompt_lp
                        )
                    raise self._worker_abort(reason)
                finish, error = normalize_finish_reason(str(raw))
                if finish == "error" and isinstance(reason, Mapping) and reason.get("message"):
                    error = str(reason["message"])
                yield EngineOutput(
                    token_ids=ids,
                    finish_reason=finish,
                    error=error,
                    usage=usage,
                    logprobs=logprobs,
                    prompt_logprobs=prompt_lp,
                )
                return
        finally:
            await self._close(first)

    def _take_prompt_logprobs(self, meta: Mapping[str, Any]) -> list[TokenLogprob] | None:
        """The prompt's logprobs from the first output's ``meta_info``, once."""
        if not self._prompt_logprobs_due:
            return None
        self._prompt_logprobs_due = False
        return prompt_logprobs(meta, self._prompt, self._request.prompt_logprobs or 0)

    async def _wait_prefill_dispatched(self, first: asyncio.Future[Any]) -> None:
        """Return once SGLang dispatched the request (its room is registered) or the step ended."""
        registry = self._tm.rid_to_state
        delay = 0.001
        with anyio.CancelScope() as scope:
            self._scope = scope
            deadline = anyio.current_time() + REGISTRATION_WAIT_S
            while not first.done():
                state = registry.get(self.rid)
                if state is not None and dispatched(state) is not False:
                    break
                if anyio.current_time() > deadline:
                    if self._owner.paused is not None:
                        raise WorkerDraining("SGLang is paused; the prefill was not dispatched")
                    raise EngineFailure("SGLang did not dispatch the prefill request in time")
                await anyio.sleep(delay)
                delay = min(delay * 2, _POLL_MAX_S)
        self._scope = None

    async def _step(self, first: asyncio.Future[Any] | None) -> Any:
        """The next chunk, ``_END``, or ``_STOPPED`` (interrupted, or the drain ran out)."""
        if self._interrupted:
            return _STOPPED
        assert self._gen is not None
        with anyio.CancelScope(deadline=self._drain_deadline) as scope:
            self._scope = scope
            try:
                # Cancelling this scope while awaiting the first-step task cancels that task too.
                return await (first if first is not None else self._gen.__anext__())
            except StopAsyncIteration:
                return _END
            except RequestError:
                raise
            except self._config.aborted_errors as exc:
                return self._aborted_before_dispatch(exc)
            except ValueError as exc:
                raise InvalidRequest(str(exc)) from exc
            except Exception as exc:
                raise EngineFailure(f"SGLang stream failed: {exc!r}") from exc
            finally:
                self._scope = None
        return _STOPPED

    # ---------------------------------------------------------------------------- endings

    def cancelled_output(self) -> EngineOutput:
        """The terminal output of a client-cancelled request."""
        usage = Usage(prompt_tokens=self._prompt, completion_tokens=self._completion)
        return EngineOutput(finish_reason="cancelled", usage=usage)

    def _stopped(self) -> EngineOutput:
        if self.client_aborted:
            self._finished = True
            return self.cancelled_output()
        raise stopped_error(self._owner, "stream", shutdown=self._shutdown)

    def _ended(self) -> EngineOutput:
        if self.client_aborted:
            return self._stopped()
        if self._shutdown or self._owner.closing:
            raise EngineShutdown("the SGLang engine shut down while the request ran")
        raise StreamIncomplete("the SGLang stream ended without a finish reason")

    def _aborted_before_dispatch(self, exc: Exception) -> _Stopped:
        """SGLang failed the request because an abort flagged it before its dispatch (in 0.5.17,
        ``pause_generation``'s abort flags every request it knows): an abort, never the client's
        invalid request. SGLang dropped the request locally: nothing is left to abort."""
        self._finished = True
        if self.client_aborted:
            return _STOPPED
        raise self._worker_abort({"type": "abort", "message": str(exc)}) from exc

    def _worker_abort(self, reason: Any) -> RequestError:
        """The error for an abort the client did not ask for: never reported as "cancelled"."""
        message = str(reason.get("message") or "") if isinstance(reason, Mapping) else ""
        return worker_abort_error(self._owner, message, reason, shutdown=self._shutdown)

    async def _close(self, first: asyncio.Future[Any]) -> None:
        """Leave nothing behind: abort a dispatched request, end the step task and generator."""
        with anyio.CancelScope(shield=True) as scope:
            scope.deadline = anyio.current_time() + CLOSE_TIMEOUT_S
            if not self._finished:
                state = self._tm.rid_to_state.get(self.rid)
                if state is not None and dispatched(state) is not False:
                    self._tm.abort_request(rid=self.rid)
            if not first.done():
                first.cancel()
            await asyncio.gather(first, return_exceptions=True)
            if self._gen is not None:
                aclose = getattr(self._gen, "aclose", None)
                if aclose is not None:
                    try:
                        await aclose()
                    except Exception:  # already failed; its error was reported by the stream
                        pass

    # ---------------------------------------------------------------------------- aborts

    def _interrupt(self) -> None:
        self._interrupted = True
        if self._scope is not None:
            self._scope.cancel()

    def _start_drain(self) -> None:
        self._drain_deadline = min(self._drain_deadline, anyio.current_time() + DRAIN_S)
        if self._scope is not None:
            self._scope.deadline = min(self._scope.deadline, self._drain_deadline)

    def _step_running(self) -> bool:
        return self._first is not None and not self._first.done()

    async def abort(self) -> None:
        """The client's abort, ordered as Dynamo orders it (see the module docstring)."""
        self.client_aborted = True
        if self._finished:
            return
        if not self._submitted:
            self._interrupt()
            return
        registry = self._tm.rid_to_state
        delay = 0.001
        deadline = anyio.current_time() + REGISTRATION_WAIT_S
        state = registry.get(self.rid)
        while state is None:
            # Only the running first step can register the rid; otherwise it never will.
            if self._finished or not self._step_running() or anyio.current_time() > deadline:
                self._interrupt()
                return
            await anyio.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)
            state = registry.get(self.rid)
        sent = await self._wait_dispatched(registry, state)
        if registry.get(self.rid) is not state or self._finished:
            return  # it finished meanwhile
        if sent is False:
            self._interrupt()  # never reached the scheduler: SGLang drops it locally
            return
        self._tm.abort_request(rid=self.rid)
        self._start_drain()
        if self._config.retry_aborts:
            await self._retry_abort(registry, state)

    async def _wait_dispatched(self, registry: Mapping[str, Any], state: Any) -> bool | None:
        delay = 0.001
        deadline = anyio.current_time() + DISPATCH_WAIT_S
        while registry.get(self.rid) is state:
            sent = dispatched(state)
            if sent is not False:
                return sent
            if anyio.current_time() >= deadline:
                return False
            await anyio.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)
        return None

    async def _retry_abort(self, registry: Mapping[str, Any], state: Any) -> None:
        delay = 0.05
        for _ in range(ABORT_RETRIES):
            await anyio.sleep(delay)
            if registry.get(self.rid) is not state or self._finished:
                return
            self._tm.abort_request(rid=self.rid)
            delay = min(delay * 2, 1.0)

    def shutdown(self) -> None:
        """The engine shuts down: abort or interrupt at once (the stream ends in EngineShutdown)."""
        self._shutdown = True
        if self._finished:
            return
        state = self._tm.rid_to_state.get(self.rid) if self._submitted else None
        if state is not None and dispatched(state) is not False:
            self._tm.abort_request(rid=self.rid)
            self._start_drain()
        else:
            self._interrupt()
