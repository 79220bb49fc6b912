"""The mock engine's configuration and timing model: plain msgspec structs.

The config is the only thing a process actor has to send to a child to build an engine, so it is a
frozen, serialisable struct with no live objects in it.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

__all__ = [
    "FAKE_BOOTSTRAP_HOST",
    "EngineRole",
    "MockEngineConfig",
    "TimingModel",
    "offset_endpoint",
]

# SGLang's ``sglang.srt.disaggregation.utils.FAKE_BOOTSTRAP_HOST``: a request bootstrapped to this
# host skips the KV transfer (warm-up and health canaries).
FAKE_BOOTSTRAP_HOST = "2.2.2.2"

EngineRole = Literal["aggregated", "prefill", "decode"]


class TimingModel(msgspec.Struct, frozen=True, kw_only=True):
    """How long a forward pass takes, by default Dynamo's mocker polynomials.

    A step that prefills ``t`` (uncached) tokens and decodes a batch at KV fraction ``p`` (the
    blocks in use, less those allocated for a KV transfer still in flight) takes
    ``prefill_ms(t) + decode_ms(p)`` milliseconds (each term only when that phase is in the step),
    divided by ``speedup``. ``instant`` removes simulated time altogether (overhead benchmarks).
    """

    prefill_a: float = 4.21e-7  # ms per token^2
    prefill_b: float = 0.0152  # ms per token
    prefill_c: float = 16.5  # ms per prefill pass
    decode_a: float = -25.74  # ms per p^2
    decode_b: float = 54.01  # ms per p
    decode_c: float = 5.74  # ms per decode pass
    speedup: float = 1.0
    instant: bool = False

    def __post_init__(self) -> None:
        if not self.speedup > 0:
            raise ValueError("speedup must be > 0")

    def prefill_ms(self, tokens: int) -> float:
        """Unscaled prefill time of a pass over ``tokens`` new tokens."""
        return self.prefill_a * tokens * tokens + self.prefill_b * tokens + self.prefill_c

    def decode_ms(self, kv_fraction: float) -> float:
        """Unscaled time of one decode pass with ``kv_fraction`` of the KV cache in use."""
        p = kv_fraction
        return self.decode_a * p * p + self.decode_b * p + self.decode_c

    def step_seconds(self, prefill_tokens: int, decoding: bool, kv_fraction: float) -> float:
        """Wall-clock seconds one step takes (0 in instant mode)."""
        if self.instant:
            return 0.0
        ms = 0.0
        if prefill_tokens > 0:
            ms += self.prefill_ms(prefill_tokens)
        if decoding:
            ms += self.decode_ms(kv_fraction)
        return ms / 1000.0 / self.speedup


class MockEngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a :class:`~actors.serving.engines.MockEngine` needs; sizes are per data-parallel
    rank.

    Endpoints: ``tcp://127.0.0.1:PORT`` or ``ipc://PATH`` only (loopback). Port ``0`` picks a free
    port for every rank; a fixed port ``P`` gives rank ``r`` port ``P + r`` (SGLang's rule); an
    ``ipc://PATH`` gives rank ``r > 0`` ``PATH_dp<r>``. ``None`` disables that socket.
    """

    role: EngineRole = "aggregated"
    model: str = "mock"
    # What the simulated model serves (protocols.engine.ModelKind): the requests it takes.
    kind: Literal["chat", "embedding", "image", "dllm"] = "chat"
    # KV cache (Dynamo mocker defaults)
    num_blocks: int = 16384
    block_size: int = 64
    kv_bytes_per_block: int = 4096  # real bytes per block; a multiple of 64
    max_running_requests: int = 256
    max_batch_tokens: int = 8192
    context_length: int = 32768
    dp_size: int = 1
    # Tokens
    vocab_size: int = 32000
    bos_token_id: int = 1
    eos_token_id: int = 2
    eos_rate: float = 0.0  # probability that the model emits EOS at a position
    default_seed: int = 0  # seed of sampled requests that bring none
    embedding_dim: int = 384  # kind "embedding": the vectors' length
    # Timing
    timing: TimingModel = msgspec.field(default_factory=TimingModel)
    instant_yield_s: float = 0.005  # instant mode: run steps this long between event-loop yields
    # Memory stand-ins (released / resumed with their tags)
    weights_bytes: int = 32 * 1024 * 1024
    cuda_graph_bytes: int = 1024 * 1024
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Publishers (SGLang's kv-events config and the scheduler metrics socket)
    kv_events_endpoint: str | None = "tcp://127.0.0.1:0"
    kv_events_replay_endpoint: str | None = "tcp://127.0.0.1:0"
    kv_events_topic: str = ""
    kv_events_buffer_steps: int = 10_000
    kv_events_hwm: int = 100_000
    metrics_endpoint: str | None = "tcp://127.0.0.1:0"
    metrics_interval_s: float = 0.05  # at most one metrics message per rank per interval
    metrics_heartbeat_s: float = 1.0  # and at least one, so late subscribers catch up
    # Disaggregation
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = 0
    transfer_timeout_s: float = 300.0  # SGLang's bootstrap timeout
    # Whether a decode engine serves a request that brings no bootstrap (computing its prompt's
    # KV itself); False stands in for SGLang's decode mode, which cannot.
    prefills_alone: bool = True
    # Diagnostics
    record_steps: bool = False
    # Fault injection (scenarios): a file holding a count; while it is > 0, ``start`` decrements
    # it and fails, so an engine crash-loops exactly that many times (across restarts).
    fail_start_file: str | None = None
    # Block diffusion (kind "dllm", see ``_dllm``): text comes out in blocks of this many tokens,
    # each after this many denoising rounds of one decode pass each.
    dllm_block_tokens: int = 8
    dllm_rounds: int = 4
    # Fault injection (tests): a dllm request's first attempt (``generated == 0``) sends one
    # output with neither tokens nor a finish after this many blocks (>= 1).
    dllm_empty_chunk_after: int | None = None

    def __post_init__(self) -> None:
        positive = {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "kv_bytes_per_block": self.kv_bytes_per_block,
            "max_running_requests": self.max_running_requests,
            "max_batch_tokens": self.max_batch_tokens,
            "context_length": self.context_length,
            "dp_size": self.dp_size,
            "vocab_size": self.vocab_size,
            "embedding_dim": self.embedding_dim,
            "dllm_block_tokens": self.dllm_block_tokens,
            "dllm_rounds": self.dllm_rounds,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.kv_bytes_per_block % 64:
            raise ValueError("kv_bytes_per_block must be a multiple of 64")
        if not 0.0 <= self.eos_rate <= 1.0:
            raise ValueError("eos_rate must be within [0, 1]")
        if not 0 <= self.eos_token_id < self.vocab_size or self.vocab_size < 2:
            raise ValueError("eos_token_id must lie in the vocabulary (of at least 2 tokens)")
        if self.dllm_empty_chunk_after is not None and self.dllm_empty_chunk_after < 1:
            # After 0 blocks, a continuation (which then carries no tokens) would get it again.
            raise ValueError("dllm_empty_chunk_after must be >= 1")
        if self.weights_bytes < 0 or self.cuda_graph_bytes < 0:
            raise ValueError("memory sizes must be >= 0")
        for endpoint in (
            self.kv_events_endpoint,
            self.kv_events_replay_endpoint,
            self.metrics_endpoint,
        ):
            if endpoint is not None:
                _check_local(endpoint)

    @property
    def kv_bytes_total(self) -> int:
        """Bytes of KV page memory per data-parallel rank."""
        return self.num_blocks * self.kv_bytes_per_block

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` tokens."""
        return math.ceil(tokens / self.block_size)


def _check_local(endpoint: str) -> None:
    # The project binds loopback or ipc only: never expose an engine socket on a network.
    if endpoint.startswith("ipc://"):
        return
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        if host in ("127.0.0.1", "localhost") and port.isdigit():
            return
    raise ValueError(f"endpoint {endpoint!r}: only tcp://127.0.0.1:PORT or ipc://PATH")


def offset_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint of data-parallel ``rank``: port + rank (port 0 stays 0), ipc path suffix."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("ipc://"):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"
