"""Embedding requests' ``dimensions``, checked the same way by every embedding engine (the mock,
``hf``, SGLang). Torch-free: the mock imports it."""

from __future__ import annotations

from protocols.engine import EmbedOptions
from protocols.errors import InvalidRequest

__all__ = ["check_dimensions", "wrong_dimensions"]


def check_dimensions(embed: EmbedOptions, native: int | None) -> None:
    """Refuse (``InvalidRequest``) ``dimensions`` below 1, or other than the model's ``native``
    size (None: not known yet, only the first check applies): vectors cannot be shortened."""
    dims = embed.dimensions
    if dims is not None and dims < 1:
        raise InvalidRequest(f"dimensions must be >= 1, got {dims}")
    if dims is not None and native is not None and dims != native:
        raise wrong_dimensions(dims, native)


def wrong_dimensions(dims: int, native: int) -> InvalidRequest:
    """The error for ``dimensions`` other than the model's."""
    return InvalidRequest(
        f"dimensions={dims} is not supported: this model's embeddings have {native} "
        "dimensions and cannot be shortened"
    )
