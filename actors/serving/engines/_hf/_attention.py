"""Paged attention over a flattened batch, plugged into transformers' attention interface.

One step runs every scheduled request's new tokens as a single sequence of batch size 1
(``input_ids`` of shape ``(1, T_total)``, per-token ``position_ids``), so the linear layers see one
matrix no matter how ragged the requests are: no padding, no padding masks. Only attention must
keep requests apart; this function does it per request segment:

1. the new keys/values of every token are written into the page pool (one scatter per layer);
2. each segment attends to its own history: a fresh prefill attends to its new keys directly,
   anything else gathers its keys from the pool;
3. attention itself is transformers' own ``sdpa_attention_forward`` with the same shapes, mask
   (``None``) and contiguity that ``model.generate`` uses, so greedy output matches it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ._kv import PagePool

__all__ = ["ATTN_IMPLEMENTATION", "Segment", "StepBatch", "register_paged_attention"]

ATTN_IMPLEMENTATION = "actorserve_paged"
BATCH_KWARG = "actorserve_batch"  # the keyword that carries the StepBatch down to attention


@dataclass(frozen=True, slots=True)
class Segment:
    """One request's slice of the flattened step: tokens ``[start, end)`` of the step sit at
    positions ``[n_past, n_past + end - start)`` of the request."""

    start: int
    end: int
    n_past: int
    page_ids: torch.Tensor  # the request's pages, in order (long, on the pool's device)
    mask: torch.Tensor | None  # bool (1, 1, q, n_past + q) for a chunk after cached tokens


@dataclass(frozen=True, slots=True)
class StepBatch:
    """What attention needs to know about the step (passed as the ``actorserve_batch`` kwarg)."""

    pool: PagePool
    page_idx: torch.Tensor  # per new token: the page it goes to
    slot_idx: torch.Tensor  # per new token: its slot in that page
    segments: tuple[Segment, ...]


def causal_chunk_mask(n_past: int, q: int, device: torch.device) -> torch.Tensor:
    """Query ``i`` (at position ``n_past + i``) may see keys ``0 ..= n_past + i``."""
    rows = torch.arange(q, device=device)[:, None] + n_past
    cols = torch.arange(n_past + q, device=device)[None, :]
    return (cols <= rows).view(1, 1, q, n_past + q)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls for every layer (see the module docstring)."""
    batch: StepBatch = kwargs.pop(BATCH_KWARG)
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    batch.pool.write(layer, batch.page_idx, batch.slot_idx, key, value)
    outputs = []
    for seg in batch.segments:
        q = query[:, :, seg.start : seg.end]
        if seg.n_past == 0:
            # What generate does on its first step: the cache hands back a contiguous copy of the
            # new keys, and no mask (is_causal) for a single unpadded sequence.
            k = key[:, :, seg.start : seg.end].contiguous()
            v = value[:, :, seg.start : seg.end].contiguous()
        else:
            k, v = batch.pool.gather(layer, seg.page_ids, seg.n_past + seg.end - seg.start)
        out, _ = sdpa_attention_forward(module, q, k, v, seg.mask, dropout=0.0, scaling=scaling)
        outputs.append(out)
    return torch.cat(outputs, dim=1), None


_registered = False


def register_paged_attention() -> str:
    """Register the attention function with transformers (idempotent); returns its name."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
        _registered = True
    return ATTN_IMPLEMENTATION
