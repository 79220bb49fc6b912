"""The KV page layout, defined once, and the engine's page pool.

A *page* holds the keys and values of ``block_size`` consecutive tokens of one request for every
layer. Its memory is one contiguous fp32 block of shape::

    (num_layers, 2, block_size, num_kv_heads, head_dim)      # 2 = (K, V)

K and V are stored after the rotary embedding (exactly what attention consumes), token-major
within a layer so that writing one decode token is one small strided copy. A run of pages is a
C-contiguous array of shape ``(n_pages, *page_shape)``; token ``t`` of a request lives in its page
``t // block_size`` at slot ``t % block_size``. Slots past the last token of the last page are
zeroed on export so transfers are deterministic.

The engine's own KV storage (:class:`PagePool`) uses this very layout, so exporting a request's
KV to a caller's buffer (registered with NIXL by the transfer layer) is one gather, and importing
it on the decode side is one scatter. The buffer may be a numpy array or a torch tensor; it is
viewed, never copied.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["KVBuffer", "KVLayout", "PagePool", "pages_needed"]

KVBuffer = np.ndarray[Any, Any] | torch.Tensor
"""A caller-provided page buffer: ``(n_pages, *page_shape)`` or any contiguous fp32 buffer of
that many elements (flat, or bytes viewed as float32)."""


def pages_needed(n_tokens: int, block_size: int) -> int:
    """How many pages hold ``n_tokens`` tokens (0 for 0 tokens)."""
    if n_tokens < 0 or block_size <= 0:
        raise ValueError(f"bad n_tokens={n_tokens} / block_size={block_size}")
    return math.ceil(n_tokens / block_size)


@dataclass(frozen=True)
class KVLayout:
    """The page layout of one model (see the module docstring)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    dtype = torch.float32

    @classmethod
    def from_config(cls, config: Any, block_size: int) -> KVLayout:
        """The layout for a transformers decoder config (Llama-style attention)."""
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return cls(int(config.num_hidden_layers), int(kv_heads), int(head_dim), block_size)

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """``(num_layers, 2, block_size, num_kv_heads, head_dim)``."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def page_numel(self) -> int:
        """Elements in one page."""
        return math.prod(self.page_shape)

    @property
    def page_nbytes(self) -> int:
        """Bytes in one page (fp32)."""
        return self.page_numel * 4

    def pages_needed(self, n_tokens: int) -> int:
        """How many pages hold ``n_tokens`` tokens."""
        return pages_needed(n_tokens, self.block_size)

    def host_buffer(self, n_pages: int) -> np.ndarray[Any, Any]:
        """A fresh zeroed host buffer of ``n_pages`` pages (for tests and simple callers; the
        transfer layer brings its own registered buffer)."""
        return np.zeros((n_pages, *self.page_shape), dtype=np.float32)

    def as_pages(self, buffer: KVBuffer, n_pages: int | None = None) -> torch.Tensor:
        """View ``buffer`` (numpy or torch, contiguous) as ``(n, *page_shape)`` fp32 pages.

        The view shares memory with ``buffer``: writes through it land in the caller's buffer.
        ``n_pages`` takes the first ``n_pages`` pages; otherwise every whole page in the buffer.
        """
        tensor = torch.from_numpy(buffer) if isinstance(buffer, np.ndarray) else buffer
        if not tensor.is_contiguous():
            raise ValueError("a KV page buffer must be contiguous")
        if tensor.dtype == torch.uint8:
            tensor = tensor.view(torch.float32)
        if tensor.dtype != self.dtype:
            raise ValueError(f"a KV page buffer must be float32 (or bytes), not {tensor.dtype}")
        flat = tensor.reshape(-1)
        available = flat.numel() // self.page_numel
        n = available if n_pages is None else n_pages
        if n > available:
            raise ValueError(f"buffer holds {available} pages, {n} needed")
        return flat[: n * self.page_numel].view(n, *self.page_shape)


class PagePool:
    """The engine's KV storage: ``num_pages`` pages in the page layout, plus a free list.

    Not thread-safe: the engine's step loop owns it (under the engine lock).
    """

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device) -> None:
        self.layout = layout
        self.num_pages = num_pages
        self.device = device
        self._pages: torch.Tensor | None = None
        self._free: list[int] = []
        self.allocate()

    # ---- memory --------------------------------------------------------------------------
    @property
    def allocated(self) -> bool:
        """False while the pool's memory is released."""
        return self._pages is not None

    def allocate(self) -> None:
        """(Re)create the storage; every page is free. ``torch.empty`` leaves untouched pages
        uncommitted, so resident memory grows only with pages actually used."""
        if self._pages is None:
            shape = (self.num_pages, *self.layout.page_shape)
            self._pages = torch.empty(shape, dtype=self.layout.dtype, device=self.device)
            self._free = list(range(self.num_pages - 1, -1, -1))  # pop() hands out 0, 1, ...

    def release(self) -> None:
        """Drop the storage (the caller has freed every page first)."""
        if self.num_free != self.num_pages and self._pages is not None:
            raise RuntimeError("cannot release the KV pool while pages are in use")
        self._pages = None
        self._free = []

    @property
    def pages(self) -> torch.Tensor:
        """The storage, ``(num_pages, *page_shape)``."""
        if self._pages is None:
            raise RuntimeError("the KV pool is released")
        return self._pages

    # ---- page accounting -----------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages free right now."""
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free pages (the caller checked ``num_free``)."""
        if n > len(self._free):
            raise RuntimeError(f"KV pool exhausted: {n} pages wanted, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, page_ids: Sequence[int]) -> None:
        """Give pages back."""
        if self._pages is not None:
            self._free.extend(reversed(page_ids))

    # ---- data ----------------------------------------------------------------------------
    def write(
        self,
        layer: int,
        page_idx: torch.Tensor,
        slot_idx: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store the K/V of new tokens: ``k``/``v`` are ``(1, heads, T, head_dim)`` and token ``i``
        goes to page ``page_idx[i]``, slot ``slot_idx[i]``."""
        kv = torch.stack((k[0].transpose(0, 1), v[0].transpose(0, 1)), dim=1)  # (T, 2, H, D)
        # Two advanced indices around a slice: the indexed dims come first, matching kv.
        self.pages[page_idx, layer, :, slot_idx] = kv

    def gather(
        self, layer: int, page_ids: torch.Tensor, n_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n_tokens`` keys and values of a request in one layer, each contiguous
        ``(1, heads, n_tokens, head_dim)`` (the shape transformers' own cache hands attention)."""
        # index_select on the layer's strided view copies just this layer's slices of the pages
        # (advanced indexing over two dims is several times slower).
        block = self.pages[:, layer].index_select(0, page_ids)  # (n_pages, 2, B, H, D)
        heads, dim = self.layout.num_kv_heads, self.layout.head_dim
        kv = block.permute(1, 3, 0, 2, 4).reshape(2, heads, -1, dim)  # one copy: (2, H, n*B, D)
        if kv.shape[2] != n_tokens:
            kv = kv[:, :, :n_tokens].contiguous()
        return kv[0:1], kv[1:2]

    def export(
        self,
        page_ids: Sequence[int],
        n_tokens: int,
        out: torch.Tensor,
        out_ids: Sequence[int] | None = None,
    ) -> None:
        """Copy a request's pages (page ``i`` holds its tokens ``[i*B, (i+1)*B)``) into ``out``
        (``(m, *page_shape)``, any device): page ``i`` goes to ``out[out_ids[i]]``, or to
        ``out[i]`` without ``out_ids``. The unused tail slots of the last page are zeroed."""
        if not page_ids:
            return
        src = self.pages.index_select(0, _index(page_ids, self.device))
        tail = n_tokens - (len(page_ids) - 1) * self.layout.block_size
        src[-1, :, :, tail:] = 0
        if out_ids is None:
            out[: len(page_ids)].copy_(src)
        else:
            out.index_copy_(0, _index(out_ids, out.device), src.to(out.device))

    def load(
        self, page_ids: Sequence[int], src: torch.Tensor, src_ids: Sequence[int] | None = None
    ) -> None:
        """The reverse of :meth:`export`: copy ``src[src_ids[i]]`` (or ``src[i]``) into pool
        page ``page_ids[i]``."""
        if not page_ids:
            return
        pages = src[: len(page_ids)] if src_ids is None else src[_index(src_ids, src.device)]
        self.pages.index_copy_(0, _index(page_ids, self.device), pages.to(self.device))


def _index(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(ids), dtype=torch.long, device=device)
