"""Control messages an engine actor answers (over the process boundary: registered with the
codec). Generation itself is a stream request carrying a ``PreprocessedRequest``."""

from __future__ import annotations

import attrs

from protocols import codec
from protocols.engine import MemoryTag, PauseMode

__all__ = [
    "Abort",
    "ContinueGeneration",
    "EngineStats",
    "FlushCache",
    "GetCapacity",
    "GetHealthPayload",
    "GetStats",
    "IsQuiescent",
    "Pause",
    "ReleaseMemory",
    "ResumeMemory",
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
    pass


@attrs.frozen
class GetHealthPayload:
    pass


@attrs.frozen
class GetStats:
    pass


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
    EngineStats,
):
    codec.register(_cls, f"control.{_cls.__name__}")
