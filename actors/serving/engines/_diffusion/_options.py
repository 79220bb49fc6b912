"""Image requests, checked the same way by every image engine (diffusers, SGLang and the mock).

Torch-free on purpose: the mock engine validates its image requests with it, and importing the
mock must never import torch.
"""

from __future__ import annotations

import math
import secrets
import uuid
from dataclasses import dataclass

from protocols.engine import ImageOptions, PreprocessedRequest
from protocols.errors import InvalidRequest

__all__ = [
    "SIZE_MULTIPLE",
    "ImageLimits",
    "check_image",
    "check_image_kind",
    "draw_seed",
    "image_arguments",
    "image_canary",
]

SIZE_MULTIPLE = 8  # every latent-diffusion VAE downsamples by a power of two of at least 8
_SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes unsigned 64-bit seeds


@dataclass(frozen=True)
class ImageLimits:
    """What an engine accepts: sizes (pixels, both sides) and denoising steps."""

    min_size: int = SIZE_MULTIPLE
    max_size: int = 2048
    max_steps: int = 1000

    def __post_init__(self) -> None:
        if self.min_size < SIZE_MULTIPLE or self.max_size < self.min_size:
            raise ValueError(f"need {SIZE_MULTIPLE} <= min_size <= max_size")
        if self.max_steps < 1:
            raise ValueError("max_steps must be >= 1")


def check_image_kind(request: PreprocessedRequest, kind: str) -> None:
    """Refuse (``InvalidRequest``) an image request on an engine of another kind, and any other
    request on an image engine."""
    if kind == "image" and request.image is None:
        raise InvalidRequest("this engine serves image models: the request needs 'image'")
    if kind != "image" and request.image is not None:
        raise InvalidRequest(f"this engine serves {kind} models, not images")


def check_image(request: PreprocessedRequest, limits: ImageLimits) -> ImageOptions:
    """The request's image options, checked against ``limits`` (``InvalidRequest`` if not)."""
    check_image_kind(request, "image")
    opts = request.image
    assert opts is not None
    if request.token_ids:
        raise InvalidRequest("an image request carries its prompt as text: token_ids is not empty")
    lo, hi = limits.min_size, limits.max_size
    for name, value in (("width", opts.width), ("height", opts.height)):
        if value % SIZE_MULTIPLE:
            raise InvalidRequest(f"{name} {value} is not a multiple of {SIZE_MULTIPLE}")
        if not lo <= value <= hi:
            raise InvalidRequest(f"{name} {value} is outside this model's range [{lo}, {hi}]")
    if not 1 <= opts.steps <= limits.max_steps:
        raise InvalidRequest(f"steps must be within [1, {limits.max_steps}], got {opts.steps}")
    if not (math.isfinite(opts.guidance_scale) and opts.guidance_scale >= 0):
        raise InvalidRequest(f"guidance_scale must be a number >= 0, got {opts.guidance_scale}")
    if opts.seed is not None and not 0 <= opts.seed < _SEED_LIMIT:
        raise InvalidRequest(f"seed must be within [0, 2**64), got {opts.seed}")
    return opts


def image_arguments(opts: ImageOptions) -> dict[str, object]:
    """The arguments every image model's call takes, by diffusers' names (SGLang's diffusion
    ``SamplingParams`` use the same): prompt, size, steps, and the negative prompt when given
    (else the model's own default)."""
    kwargs: dict[str, object] = {
        "prompt": opts.prompt,
        "width": opts.width,
        "height": opts.height,
        "num_inference_steps": opts.steps,
    }
    if opts.negative_prompt is not None:
        kwargs["negative_prompt"] = opts.negative_prompt
    return kwargs


def draw_seed() -> int:
    """A fresh seed for a request that brings none (32 bits: it fits any client's integer)."""
    return secrets.randbits(32)


def image_canary(size: int) -> PreprocessedRequest:
    """Dynamo's image canary, shrunk: prompt ``test``, one step, ``size`` x ``size`` pixels
    (fixed seed: the same picture every time), with a fresh rid (one per canary)."""
    return PreprocessedRequest(
        rid=f"health-{uuid.uuid4().hex}",
        token_ids=[],
        health_check=True,
        image=ImageOptions(prompt="test", width=size, height=size, steps=1, seed=0),
    )
