"""The seam between the HTTP frontend and whatever serves the requests (router, request streams)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Literal, Protocol, runtime_checkable

import attrs
from prometheus_client import CollectorRegistry

from protocols.engine import EngineOutput, ModelKind, PreprocessedRequest

from ._tokenizer import Tokenizer

__all__ = ["Backend", "ModelHealth", "ModelInfo", "WorkerHealth", "WorkerState"]

#: A worker as ``/health`` shows it: ``ready`` (routable), ``restarting`` (not registered:
#: starting, restarting, or left down after crash-looping), ``draining`` (taken out of routing on
#: purpose: a drain, a memory release) or ``out_of_service`` (registered but failing its canaries).
WorkerState = Literal["ready", "restarting", "draining", "out_of_service"]


@attrs.frozen
class WorkerHealth:
    """One worker of a served model, for ``/health``'s detail."""

    role: str
    state: WorkerState


@attrs.frozen
class ModelHealth:
    """Whether a served model can take requests now, why not if not, and each of its workers."""

    ready: bool
    reason: str | None = None
    workers: Mapping[str, WorkerHealth] = attrs.field(factory=dict)


@attrs.frozen
class ModelInfo:
    """A served model as the frontend sees it."""

    name: str
    context_length: int
    tokenizer: Tokenizer
    #: What it serves, hence which endpoints take it (chat and dllm: chat and completions).
    kind: ModelKind = "chat"
    #: Unix time shown as ``created`` in ``/v1/models``.
    created: int = 0
    owned_by: str = "actorserve"
    #: ``--tool-call-parser``: the format chat answers are read for tool calls in (``None``:
    #: requests with tools are refused).
    tool_call_parser: str | None = None
    #: ``--reasoning-parser``: how reasoning is split from chat answers (``None``: it is not).
    reasoning_parser: str | None = None
    #: How many token ids the model has (``logit_bias`` refuses others); ``None``: unknown.
    vocab_size: int | None = None


@runtime_checkable
class Backend(Protocol):
    """What the frontend calls; the root process's router and request-stream actors implement it.

    Cancellation contract: when the client goes away (or a stop string ends the answer early) the
    frontend stops consuming the iterator that :meth:`generate` returned. Either the task awaiting
    ``__anext__`` is cancelled (the cancellation surfaces inside the iterator), or the iterator is
    closed with ``aclose()`` (async generators see ``GeneratorExit``). Both mean "the client
    cancelled": abort the engine request, free its KV, never migrate. ``aclose()`` runs shielded
    from cancellation for a few seconds, so cleanup that must await (sending the abort) can.

    Optionally the iterator has ``next_nowait()``: an output that is already here, or ``None``
    (never waits; the end of the stream and errors are for ``__anext__`` to report). Outputs
    found that way are written to the client together, in one write. It may also have
    ``close()``: a close that never waits, used instead of ``aclose()``.

    Task contract: ``generate`` is called, and its iterator advanced and closed, from one task
    (the request's for a non-streaming request, the SSE response's for a stream). Still, keep no
    task-bound state open across a ``yield`` (a cancel scope, a task group): anyio and trio forbid
    it in async generators.
    """

    def models(self) -> list[ModelInfo]:
        """The models served now (cheap: called on every request)."""
        ...

    def generate(self, model: str, request: PreprocessedRequest) -> AsyncIterator[EngineOutput]:
        """Stream the outputs of ``request`` on ``model``.

        Outputs carry the new token ids only; the last has ``finish_reason`` (and ``usage``).
        Failures raise :class:`~protocols.errors.RequestError` subclasses, from this call or from
        the iterator: raised before the first output they become the HTTP status; after it, an SSE
        ``error`` event. A stream that ends without a finish reason is reported as truncated.
        """
        ...

    def health(self) -> Mapping[str, ModelHealth]:
        """Readiness per served model (cheap: probes call it every few seconds); ``/health`` is
        200 iff there is one and every one is ready."""
        ...

    def metrics_registry(self) -> CollectorRegistry | None:
        """A registry of the backend's own metrics to expose on ``/metrics`` too, or ``None``
        when they already live on the registry given to :func:`create_app`."""
        ...
