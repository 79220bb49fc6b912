"""The public records of the diffusers engine: its config and its statistics (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from protocols.engine import MemoryTag

from ._options import ImageLimits

__all__ = [
    "DiffusersEngineConfig",
    "DiffusersEngineStatistics",
    "decode_diffusers_config",
    "diffusers_config_from_dict",
    "encode_diffusers_config",
]


class DiffusersEngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How a ``DiffusersEngine`` runs. A plain struct: a process actor sends it to a child."""

    # A diffusers pipeline folder (``model_index.json`` and its components); None: the tiny
    # Stable-Diffusion-shaped pipeline of ``find_tiny_diffusion``, built once into the cache.
    model_dir: str | None = None
    cache_dir: str | None = None  # where find_tiny_diffusion builds it; None: the default cache
    # torch intra-op threads (process-wide in torch): on a small shared host a preempted second
    # OpenMP thread stalls every convolution at its barrier.
    num_threads: int = 1
    # Images denoised at the same time, each on its own thread with its own scheduler (the
    # weights are shared); more wait in FCFS order.
    max_concurrent: int = 1
    min_size: int = 8  # pixels, both sides (always a multiple of 8)
    max_size: int = 2048
    max_steps: int = 1000  # capped further by the scheduler's training timesteps

    def __post_init__(self) -> None:
        if self.num_threads < 1 or self.max_concurrent < 1:
            raise ValueError("num_threads and max_concurrent must be >= 1")
        self.limits()  # raises ValueError on bad sizes or steps

    def limits(self) -> ImageLimits:
        """The request limits this config sets (the model may narrow them)."""
        return ImageLimits(min_size=self.min_size, max_size=self.max_size, max_steps=self.max_steps)


def diffusers_config_from_dict(args: dict[str, Any]) -> DiffusersEngineConfig:
    """A :class:`DiffusersEngineConfig` from plain values (a config file's ``engine_args``); a
    wrong type raises ``msgspec.ValidationError``."""
    return msgspec.convert(args, DiffusersEngineConfig)


def encode_diffusers_config(config: DiffusersEngineConfig) -> bytes:
    """msgpack, as the engine host receives it (see :func:`decode_diffusers_config`)."""
    return msgspec.msgpack.encode(config)


def decode_diffusers_config(data: bytes) -> DiffusersEngineConfig:
    """The reverse of :func:`encode_diffusers_config`."""
    return msgspec.msgpack.decode(data, type=DiffusersEngineConfig)


@dataclass(frozen=True)
class DiffusersEngineStatistics:
    """A snapshot of the engine (``DiffusersEngine.statistics()``)."""

    running: int = 0  # requests being denoised (parked by a pause included)
    waiting: int = 0  # requests queued for a free lane (or for continue / resume)
    live_requests: int = 0  # streams the engine still owes an ending
    paused: bool = False
    released: frozenset[MemoryTag] = frozenset()
    steps: int = 0  # denoising steps run, over all requests (a cancelled one stops early)
    images: int = 0  # requests that ended with their picture
    cancelled: int = 0  # requests ended ``cancelled`` (abort, closed stream, pause(ABORT))
    retracted: int = 0  # runs stopped to be restarted (pause(RETRACT), a weights release)
    failed: int = 0  # requests ended by an error (shutdown included)

    def counters(self) -> dict[str, int]:
        """The figures the worker exports (``actorserve_worker_<name>``)."""
        return {
            "image_steps": self.steps,
            "images": self.images,
            "images_cancelled": self.cancelled,
        }

    # The engine contract's ``EngineStatistics``.
    @property
    def in_flight(self) -> int:
        """Requests the engine still owes an ending."""
        return self.live_requests

    @property
    def used_blocks(self) -> int:
        return 0  # no KV cache

    @property
    def prefill_tokens(self) -> int:
        return -1  # not counted

    @property
    def kv_received_tokens(self) -> int:
        return -1  # no KV transfer
