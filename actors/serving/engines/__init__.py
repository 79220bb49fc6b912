"""Engine backends behind the ``protocols.Engine`` contract.

``MockEngine`` is the default backend: a CPU-only simulated SGLang that serves the whole contract
in-process (or in a child process: its config is a plain msgspec struct and it keeps no global
state).

- **KV blocks**: a paged pool per data-parallel rank with prefix caching (chained page hashes, as
  SGLang's paged radix cache gives), LRU eviction of unreferenced cached blocks, ``cached_tokens``
  in the final usage.
- **Scheduler**: continuous batching per rank (max running requests, max batch tokens with chunked
  prefill, FCFS queue, retraction under memory pressure); a rank is picked by
  ``routing.dp_rank`` or least load.
- **Timing**: :class:`TimingModel`, by default Dynamo's mocker (prefill
  ``4.21e-7·t² + 0.0152·t + 16.5`` ms, decode ``-25.74·p² + 54.01·p + 5.74`` ms), a speed-up
  factor, or ``instant`` (no simulated time).
- **Tokens**: a deterministic function of (seed, every token before) — greedy requests ignore the
  seed, sampled ones without a seed use ``default_seed`` — with EOS at ``eos_rate``; max/min
  tokens, ``ignore_eos``, ``stop_token_ids`` and ``eos_token_ids`` honoured (stop and EOS tokens
  are included in the output, as SGLang returns them). Prompt + the first k generated tokens
  continues with exactly the rest, provided ``max_tokens`` and ``min_tokens`` are reduced by k
  (and ``generated`` says k, for what follows).
- **Steering**: a grammar (structured output, through the shared ``_grammar`` module on
  llguidance, as the ``hf`` engine's), ``logit_bias`` and the presence, frequency and repetition
  penalties choose among the tokens by deterministic pseudo-logits (the rule is in
  ``_mock/_steer``); a migrated request replays its grammar and counts its penalties over its
  ``generated`` tokens, so it continues exactly. ``prompt_logprobs`` come with the first output.
- **Memory**: real KV pages (host ``mmap``, or CUDA through torch on a GPU host) whose content is
  a deterministic function of the tokens; a weights stand-in and a CUDA-graph stand-in buffer;
  ``release_memory`` / ``resume_memory`` free and re-allocate them (visible in RSS).
- **Publishers**: KV events per rank on a ZMQ PUB (SGLang's three frames and msgpack
  ``KVEventBatch``) with a ROUTER replay socket, and ``KvMetrics`` load metrics as msgpack maps
  on one PUB socket for all ranks. ``Capacity.kv_events_endpoints`` /
  ``kv_events_replay_endpoints`` / ``metrics_endpoint`` say where;
  the wire formats are :mod:`protocols.kv_events`, and the worker's publisher consumes them (from
  SGLang too).
- **Disaggregation** (``role="prefill"`` / ``"decode"``): the engines move no bytes; a transfer
  layer does, between the buffers ``kv_memory(rank)`` / ``kv_buffer(rank)`` describe::

      stream = decode.generate(req)                    # req.bootstrap_info set (a real host)
      dst = await decode.wait_transfer_target(rid)     # fresh blocks for the prompt's pages
      await drain(prefill.generate(req))               # one token, disaggregated_params
      src = await prefill.wait_transfer_source(rid)    # the prefill's blocks, held ("owed")
      ... WRITE page i: src.block_ids[i] -> dst.block_ids[i] (offsets: block_id * block_bytes)
      decode.complete_transfer(rid)                    # verifies every page, then decodes
      prefill.release_transfer(rid)                    # frees the owed blocks

  ``decode.fail_transfer(rid, why)`` ends the stream with ``KVTransferError``; a page that fails
  verification ends it with ``KVCorrupted``; unclaimed transfers time out
  (``transfer_timeout_s``). ``verify_pages(block_ids, tokens)``, ``page_hash``,
  ``prompt_page_hashes``, ``page_content`` and ``page_checksum`` let the transfer layer check
  pages itself. Requests bootstrapped to :data:`FAKE_BOOTSTRAP_HOST` skip all of it.

Streams raise typed errors from ``protocols.errors``: ``KVCorrupted`` / ``KVTransferError`` (decode
transfer), ``EngineShutdown`` (cleanup while running), ``InvalidRequest`` /
``ContextLengthExceeded`` (validation). ``pause(ABORT)`` and ``abort`` end streams with
``finish_reason="cancelled"``, as SGLang does.
"""

from typing import TYPE_CHECKING

from actors.serving.engines._mock._config import (
    FAKE_BOOTSTRAP_HOST,
    EngineRole,
    MockEngineConfig,
    TimingModel,
    offset_endpoint,
)
from actors.serving.engines._mock._engine import MockEngine
from actors.serving.engines._mock._kvmem import (
    KvMemoryInfo,
    page_checksum,
    page_content,
    resolve_device,
)
from actors.serving.engines._mock._loop import StepRecord
from actors.serving.engines._mock._pool import BlockPoolStatistics
from actors.serving.engines._mock._request import EngineStream
from actors.serving.engines._mock._stats import MockEngineStatistics, RankStatistics
from actors.serving.engines._mock._transfer import KvPages, Offer
from actors.serving.errors import MockEngineBusy, ModelPackageMissing, SGLangRequiresAsyncio

if TYPE_CHECKING:
    from actors.serving.engines._diffusion import (
        DiffusersEngine,
        DiffusersEngineConfig,
        DiffusersEngineStatistics,
        decode_diffusers_config,
        diffusers_config_from_dict,
        encode_diffusers_config,
        find_tiny_diffusion,
        tiny_pipeline,
    )
    from actors.serving.engines._hf import (
        HFEngine,
        HFEngineConfig,
        HFEngineStatistics,
        KVBuffer,
        KVLayout,
        ModelFiles,
        PrefilledKV,
        config_from_dict,
        decode_config,
        default_cache_dir,
        encode_config,
        find_smollm2,
        load_model,
        pages_needed,
    )
    from actors.serving.engines._hf._embed import (
        HFEmbeddingConfig,
        HFEmbeddingEngine,
        HFEmbeddingStatistics,
        decode_embedding_config,
        embedding_config_from_dict,
        encode_embedding_config,
    )
    from actors.serving.engines._hf._minilm import find_minilm
    from actors.serving.engines._sglang import (
        SGLangEngine,
        SGLangImageEngine,
        SGLangMetricsReader,
        server_args_from_cli,
    )

# Backends with heavy or GPU-only dependencies load on first use: importing actorserve never
# imports sglang (or torch).
_LAZY = {
    **dict.fromkeys(
        (
            "DiffusersEngine",
            "DiffusersEngineConfig",
            "DiffusersEngineStatistics",
            "decode_diffusers_config",
            "diffusers_config_from_dict",
            "encode_diffusers_config",
            "find_tiny_diffusion",
            "tiny_pipeline",
        ),
        "actors.serving.engines._diffusion",
    ),
    **dict.fromkeys(
        (
            "HFEngine",
            "HFEngineConfig",
            "HFEngineStatistics",
            "KVBuffer",
            "KVLayout",
            "ModelFiles",
            "PrefilledKV",
            "config_from_dict",
            "decode_config",
            "default_cache_dir",
            "encode_config",
            "find_smollm2",
            "load_model",
            "pages_needed",
        ),
        "actors.serving.engines._hf",
    ),
    **dict.fromkeys(
        (
            "HFEmbeddingConfig",
            "HFEmbeddingEngine",
            "HFEmbeddingStatistics",
            "decode_embedding_config",
            "embedding_config_from_dict",
            "encode_embedding_config",
        ),
        "actors.serving.engines._hf._embed",
    ),
    "find_minilm": "actors.serving.engines._hf._minilm",
    "SGLangEngine": "actors.serving.engines._sglang",
    "SGLangImageEngine": "actors.serving.engines._sglang",
    "SGLangMetricsReader": "actors.serving.engines._sglang",
    "server_args_from_cli": "actors.serving.engines._sglang",
}


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)


__all__ = [
    "FAKE_BOOTSTRAP_HOST",
    "BlockPoolStatistics",
    "DiffusersEngine",
    "DiffusersEngineConfig",
    "DiffusersEngineStatistics",
    "EngineRole",
    "EngineStream",
    "HFEmbeddingConfig",
    "HFEmbeddingEngine",
    "HFEmbeddingStatistics",
    "HFEngine",
    "HFEngineConfig",
    "HFEngineStatistics",
    "KVBuffer",
    "KVLayout",
    "KvMemoryInfo",
    "KvPages",
    "MockEngine",
    "MockEngineBusy",
    "MockEngineConfig",
    "MockEngineStatistics",
    "ModelFiles",
    "ModelPackageMissing",
    "Offer",
    "PrefilledKV",
    "RankStatistics",
    "SGLangEngine",
    "SGLangImageEngine",
    "SGLangMetricsReader",
    "SGLangRequiresAsyncio",
    "StepRecord",
    "TimingModel",
    "config_from_dict",
    "decode_config",
    "decode_diffusers_config",
    "decode_embedding_config",
    "default_cache_dir",
    "diffusers_config_from_dict",
    "embedding_config_from_dict",
    "encode_config",
    "encode_diffusers_config",
    "encode_embedding_config",
    "find_minilm",
    "find_smollm2",
    "find_tiny_diffusion",
    "load_model",
    "offset_endpoint",
    "page_checksum",
    "page_content",
    "pages_needed",
    "resolve_device",
    "server_args_from_cli",
    "tiny_pipeline",
]
