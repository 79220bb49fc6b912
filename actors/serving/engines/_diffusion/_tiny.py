"""A tiny Stable-Diffusion-shaped pipeline with seeded random weights, built offline.

It is the diffusers engine's default model and the tests' one: every component is a real
diffusers / transformers class made from a config (UNet2DConditionModel, AutoencoderKL,
CLIPTextModel with a byte-level CLIPTokenizer, DDIMScheduler), saved with ``save_pretrained``,
so an engine loads it through ``DiffusionPipeline.from_pretrained`` like any downloaded model.
Its pictures are noise (nothing is trained), but shapes, seeding, steps and cancellation behave
as a real model's do, a 64x64 picture in a few steps taking tens of milliseconds on one core.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .._hf._model import default_cache_dir, file_lock

__all__ = ["TINY_CONTEXT", "find_tiny_diffusion", "tiny_pipeline"]

_FORMAT = 1  # bump when the pipeline's shape changes: a new cache folder is built
_MARKER = "actorserve-tiny.json"
TINY_CONTEXT = 32  # the text encoder's positions (prompts are truncated to this many tokens)


def _byte_vocab() -> dict[str, int]:
    """CLIP's byte-level alphabet (GPT-2's bytes-to-unicode map), each symbol also with CLIP's
    end-of-word mark, plus the two special tokens: with no merges, every byte is one token."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    shifted = iter(range(256, 512))
    symbols = [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]
    words = [*symbols, *(s + "</w>" for s in symbols), "<|startoftext|>", "<|endoftext|>"]
    return {word: i for i, word in enumerate(words)}


def tiny_pipeline(folder: Path, seed: int = 0) -> Path:
    """Build the tiny pipeline (weights drawn from ``seed``) and save it into ``folder``
    (created if missing); returns ``folder``. The same seed gives the same weights."""
    import torch
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    vocab = _byte_vocab()
    start, end = vocab["<|startoftext|>"], vocab["<|endoftext|>"]
    # A private RNG state: building a model must not move the caller's global torch RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tokenizer = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=TINY_CONTEXT)
        text_encoder = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=len(vocab),
                hidden_size=32,
                intermediate_size=64,
                num_attention_heads=4,
                num_hidden_layers=2,
                max_position_embeddings=TINY_CONTEXT,
                projection_dim=32,
                bos_token_id=start,
                eos_token_id=end,
                pad_token_id=end,
            )
        )
        unet = UNet2DConditionModel(  # type: ignore[no-untyped-call]
            sample_size=8,
            in_channels=4,
            out_channels=4,
            block_out_channels=(32, 64),
            layers_per_block=1,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            cross_attention_dim=32,
            attention_head_dim=(2, 4),
            norm_num_groups=32,
        )
        # Four blocks: the VAE scales by 8, as Stable Diffusion's does (64x64 pixels: 8x8 latents).
        vae = AutoencoderKL(  # type: ignore[no-untyped-call]
            in_channels=3,
            out_channels=3,
            block_out_channels=(8, 8, 16, 16),
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=8,
            sample_size=64,
        )
    scheduler = DDIMScheduler(  # type: ignore[no-untyped-call]
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    pipe: Any = StableDiffusionPipeline(  # type: ignore[no-untyped-call]
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    folder.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(str(folder))
    return folder


def find_tiny_diffusion(cache_dir: Path | None = None) -> Path:
    """The tiny pipeline's folder in the actorserve model cache, built on first use.

    Safe from several processes at once: one builds (under a file lock) into a temporary
    sibling folder renamed into place, so no reader ever sees a half-written pipeline.
    """
    root = cache_dir or default_cache_dir()
    folder = root / f"tiny-diffusion-v{_FORMAT}"
    if (folder / _MARKER).is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / f".{folder.name}.lock"):
        if (folder / _MARKER).is_file():  # another process built it while we waited
            return folder
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=root))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared by users of the host
        try:
            tiny_pipeline(tmp, seed=0)
            (tmp / _MARKER).write_text(json.dumps({"format": _FORMAT, "seed": 0}))
            if folder.exists():  # an incomplete leftover of an interrupted older build
                shutil.rmtree(folder)
            tmp.rename(folder)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return folder
