"""Control messages an engine actor answers (over the process boundary: registered with the
codec). Generation itself is a stream request carrying a ``PreprocessedRequest``."""

from __future__ import annotations

import math

import attrs

from protocols import codec
from protocols.engine import MemoryTag, PauseMode

__all__ = [
    "Abort",
    "ConnectPeer",
    "ContinueGeneration",
    "Drain",
    "EngineStats",
    "FlushCache",
    "GetCapacity",
    "GetHealthPayload",
    "GetStats",
    "Histogram",
    "InjectFault",
    "IsQuiescent",
    "Pause",
    "Perturb",
    "ReleaseMemory",
    "ResumeMemory",
    "Undrain",
    "WaitQuiescent",
]


@attrs.frozen
class GetCapacity:
    pass


@attrs.frozen
class Abort:
    rid: str


@attrs.frozen
class Pause:
    mode: PauseMode = PauseMode.ABORT


@attrs.frozen
class ContinueGeneration:
    pass


@attrs.frozen
class ReleaseMemory:
    tags: tuple[MemoryTag, ...]


@attrs.frozen
class ResumeMemory:
    tags: tuple[MemoryTag, ...]


@attrs.frozen
class FlushCache:
    pass


@attrs.frozen
class IsQuiescent:
    pass


@attrs.frozen
class WaitQuiescent:
    """A stream request (not an ask, so the engine actor's mailbox keeps serving meanwhile):
    the stream ends, with no item, once the engine is quiescent."""


@attrs.frozen
class GetHealthPayload:
    pass


@attrs.frozen
class GetStats:
    pass


@attrs.frozen
class Drain:
    """Stop admitting: new streams fail with ``WorkerDraining``; with ``handover`` the running
    ones are aborted and end with ``WorkerDraining`` too (so their request streams migrate them),
    never with a ``cancelled`` finish.

    With ``live`` (and not ``shutdown``), a decode worker that can hand its KV over keeps each
    decoding request's pages (all at its engine's next step boundary: a step in flight delivers
    its tokens first) and ends its stream with one more output whose ``disaggregated_params``
    name a room of its KV bootstrap endpoint: the next decode worker reads the KV from there and
    continues without a prefill (live migration). Requests it cannot hand over that way are
    aborted for token replay."""

    handover: bool = True
    shutdown: bool = False  # end handed-over streams with EngineShutdown instead
    live: bool = True


@attrs.frozen
class Undrain:
    """Admit requests again; with ``continue_generation``, first continue a paused engine (one
    round trip where a resume needs both)."""

    continue_generation: bool = False


@attrs.frozen
class ConnectPeer:
    """Decode: meet the prefill worker whose KV bootstrap endpoint this is (pre-warm)."""

    endpoint: str


@attrs.frozen
class InjectFault:
    """Fault injection for tests and scenarios: the next ``count`` calls of ``operation``
    (``release_memory``, ``resume_memory``, ``pause``, ``generate``, ``health``: the health
    checker's canary payload) raise; on a decode worker with our KV bridge, the next ``count``
    transfers fail (``fail_kv``) or arrive with a flipped byte (``corrupt_kv``); on a prefill
    worker with it, the next ``count`` prefills never send their KV (``hold_kv``: decode waits
    for it until the prefill is gone)."""

    operation: str
    count: int = 1


@attrs.frozen
class Perturb:
    """Fault injection for scenarios, acting at once on the engine actor: ``crash`` raises a
    non-reply error out of the handler (the engine actor crashes and its supervisor restarts it);
    ``hang`` stops generation without telling anyone (the process still answers heartbeats and
    stats, as a hung GPU would); ``unhang`` undoes it; ``slow`` divides the engine's speed by
    ``factor`` from its next step on (``factor`` 1 restores it; mock engine only)."""

    action: str
    factor: float = 1.0


@attrs.frozen
class Histogram:
    """A histogram's state: ``counts[i]`` observations in bucket ``i`` (at most ``bounds[i]``
    and above the bound before it; the last bucket, one past ``bounds``, is ``+Inf``)."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float = 0.0

    @classmethod
    def empty(cls, bounds: tuple[float, ...]) -> Histogram:
        return cls(bounds, (0,) * (len(bounds) + 1))

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus' buckets: ``(le, observations <= le)``, ``+Inf`` last."""
        out: list[tuple[str, int]] = []
        running = 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == math.inf else repr(float(bound)), running))
        return out


@attrs.frozen
class EngineStats:
    """What the worker's health checker and the lifecycle read from an engine actor."""

    running: int
    finished: int
    last_output: float  # time.monotonic() of the last output (system-wide clock)
    released: tuple[MemoryTag, ...]
    quiescent: bool
    kv_used_blocks: int = -1  # blocks held by requests (not the prefix cache); -1: unknown
    engine_in_flight: int = -1  # requests the engine itself still tracks; -1: unknown
    pid: int = 0  # the engine process
    admitting: bool = True
    paused: bool = False  # generation paused by the lifecycle (not by a fault)
    prefill_tokens: int = -1  # tokens the engine computed by prefill; -1: unknown
    kv_received_tokens: int = -1  # tokens whose KV arrived by transfer instead; -1: unknown
    handovers_live: int = 0  # drained requests offered to the next worker with their KV
    handovers_replay: int = 0  # drained requests aborted for token replay
    handovers_open: int = 0  # live hand-overs whose KV has not been read (or given up) yet
    kv_write_seconds: float = 0.0  # its KV's WRITEs (prefill, hand-overs), posting to DONE, summed
    transfer_pages: int = 0  # pages the KV bridge holds for transfers now (0 when idle)
    # Of ``running``, those that have streamed an output (not waiting to prefill, or for the
    # KV of a disaggregated request).
    streaming: int = 0
    # An engine's figures of its own kind, by name: an embedding engine's batches, an image
    # engine's denoising steps (counters only grow); exported to Prometheus by the publisher.
    counters: dict[str, int] = attrs.field(factory=dict)
    histograms: dict[str, Histogram] = attrs.field(factory=dict)


for _cls in (
    GetCapacity,
    Abort,
    Pause,
    ContinueGeneration,
    ReleaseMemory,
    ResumeMemory,
    FlushCache,
    IsQuiescent,
    WaitQuiescent,
    GetHealthPayload,
    GetStats,
    Histogram,
    EngineStats,
    Drain,
    Undrain,
    ConnectPeer,
    InjectFault,
    Perturb,
):
    codec.register(_cls, f"control.{_cls.__name__}")
