"""The engine contract: request and output types, capacity, and the :class:`Engine` protocol.

It mirrors what SGLang offers and what Dynamo's backends promise. Requests follow Dynamo's
``PreprocessedRequest`` (token ids in, token ids out); outputs carry only the *new* token ids of
each step (SGLang's incremental streaming), a normalised finish reason, and usage on the last one.

These are ``msgspec`` structs: they sit on the hot path and cross process boundaries.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Literal, Protocol, runtime_checkable

import msgspec

from protocols import codec

__all__ = [
    "BootstrapInfo",
    "Capacity",
    "EmbedOptions",
    "Engine",
    "EngineOutput",
    "EngineRole",
    "EngineStatistics",
    "FinishReason",
    "Grammar",
    "GrammarKind",
    "HealthPayload",
    "ImageOptions",
    "MemoryTag",
    "ModelKind",
    "OutputStream",
    "PauseMode",
    "PreprocessedRequest",
    "RoutingHints",
    "SamplingOptions",
    "StopConditions",
    "TokenLogprob",
    "Usage",
    "normalize_finish_reason",
]


class PauseMode(enum.Enum):
    """How ``pause`` treats running requests (SGLang's ``PauseGenerationReqInput.mode``)."""

    ABORT = "abort"  # abort and return every in-flight request
    RETRACT = "retract"  # requeue running requests; their KV may be flushed
    IN_PLACE = "in_place"  # keep running requests and their KV where they are


class MemoryTag(enum.Enum):
    """What ``release_memory`` / ``resume_memory`` act on (SGLang's memory-saver tags)."""

    KV_CACHE = "kv_cache"
    WEIGHTS = "weights"
    CUDA_GRAPH = "cuda_graph"


DEFAULT_RELEASE_TAGS: frozenset[MemoryTag] = frozenset({MemoryTag.KV_CACHE, MemoryTag.WEIGHTS})

FinishReason = Literal["stop", "length", "cancelled", "error"]

EngineRole = Literal["aggregated", "prefill", "decode"]
"""An engine's part in serving: the whole request, or one half of a disaggregated pair."""


class StopConditions(msgspec.Struct, kw_only=True, omit_defaults=True):
    max_tokens: int | None = None
    min_tokens: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False


GrammarKind = Literal["json_schema", "json_object", "regex", "ebnf", "structural_tag"]


class Grammar(msgspec.Struct, frozen=True, kw_only=True):
    """A constraint on the tokens an engine may generate, applied as a mask on each step.

    ``spec`` by ``kind``: ``json_schema``, the schema as JSON text; ``json_object``, nothing (any
    JSON object); ``regex``, a regular expression the whole output matches; ``ebnf``, a grammar
    in SGLang's EBNF dialect; ``structural_tag``, SGLang's structural-tag JSON (free text with
    constrained sections, as tool calls need). The mask is a function of the tokens generated so
    far, so a continuation replays it over its ``generated`` tokens.
    """

    kind: GrammarKind
    spec: str = ""


class SamplingOptions(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How the next token is chosen. One request is one choice: a client's ``n > 1`` is that
    many requests over the same prompt (which the prefix cache shares).

    ``logit_bias`` adds to a token's logit before sampling (OpenAI's -100..100; -100 bans it).
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    guided_decoding: Grammar | None = None


class BootstrapInfo(msgspec.Struct, frozen=True, kw_only=True):
    """SGLang's disaggregation bootstrap triple: the prefill worker's endpoint and a room."""

    host: str
    port: int
    room: int


class RoutingHints(msgspec.Struct, kw_only=True, omit_defaults=True):
    dp_rank: int | None = None
    priority: int | None = None


ModelKind = Literal["chat", "embedding", "image", "dllm"]
"""What a model serves: ``chat`` (chat and completions, token by token), ``embedding`` (vectors),
``image`` (pictures), ``dllm`` (chat and completions from a block-diffusion model: several tokens
per denoising round)."""


class EmbedOptions(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Asks an embedding engine for the vector of a request's ``token_ids`` (one output).

    ``dimensions`` keeps the vector's first that many components (models trained for it); an
    engine whose model cannot fails the request with ``InvalidRequest``.
    """

    dimensions: int | None = None


class ImageOptions(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Asks an image engine for one picture (a request's ``token_ids`` are empty).

    ``seed`` makes the picture reproducible (``None``: the engine draws one). ``progress``
    asks for an output after every denoising step (``step`` set, no image) before the last.
    """

    prompt: str
    negative_prompt: str | None = None
    width: int = 512
    height: int = 512
    steps: int = 50
    guidance_scale: float = 7.5
    seed: int | None = None
    progress: bool = False


class PreprocessedRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A tokenised request, as Dynamo's frontend hands it to a worker.

    ``rid`` is submitted to the engine as its request id, so an abort is addressable before the
    first token. ``live_migration`` marks a decode request whose KV (every token but the last)
    comes from a draining decode worker through ``bootstrap_info``: the engine admits it at once
    or fails it with ``KVTransferError`` (never queues it), so its request stream can fall back
    to token replay without waiting; its first output repeats the last token.

    ``logprobs`` asks for each new token's log probability and that many most likely
    alternatives (0: the token's own only); ``None``: no log probabilities. ``prompt_logprobs``
    asks the same of the prompt's tokens (for ``echo``), sent once on the first output.

    ``generated`` says how many of the last ``token_ids`` were generated by earlier attempts of
    the same request (a continuation after a migration): they count as output for penalties,
    and a grammar is replayed over them.

    ``embed`` or ``image`` make it a request of that kind, for an engine of that kind: one
    output with the vector or the picture instead of generated tokens.

    ``traceparent`` is the W3C trace context of the attempt that sent it (only while the root
    traces requests), for an engine that continues the trace (SGLang's
    ``external_trace_header``).
    """

    rid: str
    token_ids: list[int]
    stop_conditions: StopConditions = msgspec.field(default_factory=StopConditions)
    sampling_options: SamplingOptions = msgspec.field(default_factory=SamplingOptions)
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    bootstrap_info: BootstrapInfo | None = None
    routing: RoutingHints | None = None
    model: str | None = None
    health_check: bool = False
    live_migration: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    generated: int = 0
    embed: EmbedOptions | None = None
    image: ImageOptions | None = None
    traceparent: str | None = None


class Usage(msgspec.Struct, kw_only=True, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One generated token's log probability, and the most likely tokens (``top_ids``, most
    likely first) with theirs, all from the distribution the token was drawn from."""

    logprob: float
    top_ids: list[int] = msgspec.field(default_factory=list)
    top_logprobs: list[float] = msgspec.field(default_factory=list)


class EngineOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One step of a generation stream: the *new* token ids only.

    The terminal output has ``finish_reason`` set and carries ``usage``; ``error`` holds the
    message when ``finish_reason == "error"``. A prefill worker's first output carries
    ``disaggregated_params`` (the bootstrap triple decode needs).

    A draining decode worker's output that is not terminal may carry ``disaggregated_params``
    too: an offer of the request's KV (live migration), sent as the drain begins, before the
    stream ends with ``WorkerDraining``. ``handover_tokens`` then says how many tokens of the
    request's sequence (its ``token_ids``, then its output tokens) the offered KV will hold, so
    that the next decode worker can be asked for the continuation while the draining engine's
    step in flight still runs.

    ``logprobs`` (when the request asked for them) has one entry per new token id;
    ``prompt_logprobs`` (when asked for, on the first output only) one per prompt token after the
    first (which has no logprob: nothing comes before it).

    ``embedding`` (an ``embed`` request's answer) is the vector as little-endian float32 bytes,
    the layout OpenAI's ``encoding_format: base64`` sends. ``image`` (an ``image`` request's) is
    a PNG; ``step`` counts the denoising steps done when the request asked for progress.
    """

    token_ids: list[int] = msgspec.field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    usage: Usage | None = None
    disaggregated_params: BootstrapInfo | None = None
    handover_tokens: int | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    embedding: bytes | None = None
    image: bytes | None = None
    step: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Capacity(msgspec.Struct, frozen=True, kw_only=True):
    """What ``Engine.start`` reports; the router and registration use it."""

    total_kv_blocks: int
    block_size: int
    max_running_requests: int
    max_batch_tokens: int
    context_length: int
    dp_size: int = 1
    # Where other workers read this one's KV (room unused, 0): a prefill worker's bootstrap
    # endpoint, or a decode worker's for live migration when it drains.
    bootstrap: BootstrapInfo | None = None
    kv_events_endpoints: tuple[str, ...] = ()  # one per data-parallel rank
    kv_events_replay_endpoints: tuple[str, ...] = ()  # ROUTER replay, one per rank (or none)
    metrics_endpoint: str | None = None
    # SGLang's schedulers PUSH their load metrics to an ipc path nobody binds: the reader binds a
    # PULL there and reads SGLang's own encoding (otherwise: a PUB the reader subscribes to).
    metrics_pushed: bool = False
    # A decode engine that computes a prompt's KV itself when no prefill worker can (the
    # decode-only fallback); SGLang's decode mode cannot: its requests wait for a prefill worker.
    prefills_alone: bool = True


class HealthPayload(msgspec.Struct, frozen=True, kw_only=True):
    """The role's minimal canary request (sent as a ``PreprocessedRequest``)."""

    request: PreprocessedRequest


def normalize_finish_reason(raw: str | None) -> tuple[FinishReason | None, str | None]:
    """Normalise an engine finish reason the way Dynamo does.

    Any reason starting with ``abort`` becomes ``cancelled``; ``error`` or ``error: msg`` becomes
    ``error`` with the message; ``stop`` and ``length`` pass through.
    """
    if raw is None:
        return None, None
    if raw.startswith("abort"):
        return "cancelled", None
    if raw == "error":
        return "error", "backend error"
    if raw.startswith("error:"):
        return "error", raw.removeprefix("error:").strip() or "backend error"
    if raw in ("stop", "length"):
        return raw, None  # type: ignore[return-value]
    return "stop", None


class OutputStream(Protocol):
    """What ``Engine.generate`` returns: the request's outputs, and ``aclose`` to stop reading
    early, which aborts the request (an async generator is one)."""

    def __aiter__(self) -> AsyncIterator[EngineOutput]: ...

    def __anext__(self) -> Awaitable[EngineOutput]: ...

    def aclose(self) -> Awaitable[None]: ...


class EngineStatistics(Protocol):
    """What every engine's ``statistics()`` snapshot tells its host; an engine's own snapshot
    type adds its details. A count the engine does not keep is -1.

    A snapshot may also have ``counters() -> dict[str, int]`` and ``histograms() -> dict[str,
    protocols.control.Histogram]``: figures of the engine's kind (an embedding engine's batch
    sizes, an image engine's denoising steps), which the worker exports to Prometheus as
    ``actorserve_worker_<name>``.
    """

    @property
    def in_flight(self) -> int:
        """Requests the engine still owes an ending."""
        ...

    @property
    def used_blocks(self) -> int:
        """KV blocks held by requests (not by the prefix cache)."""
        ...

    @property
    def prefill_tokens(self) -> int:
        """Tokens the engine computed by prefill."""
        ...

    @property
    def kv_received_tokens(self) -> int:
        """Tokens whose KV arrived by transfer instead of prefill."""
        ...

    @property
    def released(self) -> frozenset[MemoryTag]:
        """Memory ``release_memory`` released and ``resume_memory`` has not brought back."""
        ...


@runtime_checkable
class Engine(Protocol):
    """The contract every backend (mock, sglang, hf) implements.

    ``cleanup`` is idempotent and runs its work exactly once, also when ``start`` raised.
    Synchronous engine calls (SGLang's ``release_memory_occupation`` and friends) must never block
    the event loop: backends run them in a worker thread.
    """

    @property
    def role(self) -> EngineRole:
        """Aggregated, or the prefill or decode half of a disaggregated pair."""
        ...

    async def start(self) -> Capacity: ...

    def generate(self, request: PreprocessedRequest) -> OutputStream:
        """Stream the outputs of ``request``. Closing the stream early aborts the request."""
        ...

    async def abort(self, rid: str) -> None:
        """Abort ``rid`` in any phase, before its first token too; frees its KV."""
        ...

    async def pause(self, mode: PauseMode) -> None: ...

    async def continue_generation(self) -> None: ...

    async def release_memory(self, tags: Sequence[MemoryTag]) -> None: ...

    async def resume_memory(self, tags: Sequence[MemoryTag]) -> None: ...

    async def flush_cache(self) -> bool: ...

    def is_quiescent(self) -> bool:
        """True when no request is running or owed (prefill: no KV transfer outstanding)."""
        ...

    async def wait_quiescent(self) -> None:
        """Return once :meth:`is_quiescent`."""
        ...

    def health_payload(self) -> PreprocessedRequest: ...

    def statistics(self) -> EngineStatistics:
        """A snapshot of the engine's state."""
        ...

    async def cleanup(self) -> None: ...


for _cls in (
    StopConditions,
    SamplingOptions,
    BootstrapInfo,
    RoutingHints,
    PreprocessedRequest,
    Usage,
    TokenLogprob,
    EngineOutput,
    Capacity,
    PauseMode,
    MemoryTag,
):
    codec.register(_cls, f"engine.{_cls.__name__}")
