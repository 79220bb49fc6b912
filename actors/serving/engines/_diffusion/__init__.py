"""The ``diffusers`` engine backend: image generation behind the engine contract.

Public names: :class:`DiffusersEngine` (any diffusers pipeline folder, fp32 on the CPU, denoising
stoppable between steps) and :class:`DiffusersEngineConfig`; :func:`tiny_pipeline` /
:func:`find_tiny_diffusion` (a tiny Stable-Diffusion-shaped pipeline with seeded random weights,
built offline: the tests' model and the default); the request checks every image engine shares
(:func:`check_image`, :class:`ImageLimits`, :func:`image_canary`).

The engine and the tiny pipeline load on first use: the config and the checks are torch-free, so
the mock engine imports them without importing torch or diffusers.
"""

from typing import TYPE_CHECKING

from ._config import (
    DiffusersEngineConfig,
    DiffusersEngineStatistics,
    decode_diffusers_config,
    diffusers_config_from_dict,
    encode_diffusers_config,
)
from ._options import ImageLimits, check_image, check_image_kind, draw_seed, image_canary

if TYPE_CHECKING:
    from ._engine import DiffusersEngine
    from ._lanes import ImageStream, encode_png
    from ._tiny import find_tiny_diffusion, tiny_pipeline

_LAZY = {
    "DiffusersEngine": "._engine",
    "ImageStream": "._lanes",
    "encode_png": "._lanes",
    "find_tiny_diffusion": "._tiny",
    "tiny_pipeline": "._tiny",
}


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name], __name__), name)


__all__ = [
    "DiffusersEngine",
    "DiffusersEngineConfig",
    "DiffusersEngineStatistics",
    "ImageLimits",
    "ImageStream",
    "check_image",
    "check_image_kind",
    "decode_diffusers_config",
    "diffusers_config_from_dict",
    "draw_seed",
    "encode_diffusers_config",
    "encode_png",
    "find_tiny_diffusion",
    "image_canary",
    "tiny_pipeline",
]
