"""A cheap per-page checksum, computed where the pages live (numpy on host, torch on GPU).

``checksum(page) = sum_j word_j * w_j  (mod 2**64)`` over the page's little-endian 64-bit words,
with ``w_j = (2j + 1) * 0x9E3779B97F4A7C15``: every weight is odd, so any single-bit flip changes
the sum, and weights differ by position, so swapped words are caught too. It is one
multiply-add pass (a matrix-vector product on host memory, ~10 GB/s on these CPUs; one fused
kernel per chunk on a GPU), and numpy's uint64 and torch's int64 arithmetic wrap identically, so
a host pool and a GPU pool agree on every page's checksum.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from actors.serving.kv._pool import KVPool

__all__ = ["checksums_of", "page_checksums"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_CHUNK_BYTES = 64 << 20  # bounds the temporary a GPU chunk needs


@lru_cache(maxsize=8)
def _weights(words: int) -> npt.NDArray[np.uint64]:
    w = np.arange(words, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    w *= _GOLDEN
    w.setflags(write=False)
    return w


def checksums_of(pages: npt.NDArray[np.uint8] | Any) -> npt.NDArray[np.uint64]:
    """Checksums of a ``(n, page_bytes)`` uint8 array (numpy, or torch on any device)."""
    if isinstance(pages, np.ndarray):
        return _host_checksums(pages)
    if pages.device.type == "cpu":
        return _host_checksums(pages.numpy())
    return _torch_checksums(pages)


def page_checksums(pool: KVPool, pages: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
    """Checksums of ``pages`` of ``pool``, in the given order."""
    host = pool.host_view
    if host is not None:
        from actors.serving.kv._alloc import runs

        w = _weights(pool.page_bytes // 8)
        # Run by run: no gather copy; a contiguous run is one matrix-vector product.
        parts = [host[first : first + count].view(np.uint64) @ w for first, count in runs(pages)]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.uint64)
    tensor = pool.tensor_view
    assert tensor is not None
    import torch

    index = torch.tensor(pages, device=tensor.device)  # a copy: pages may be read-only
    per_chunk = max(1, _CHUNK_BYTES // pool.page_bytes)
    parts = [
        _torch_checksums(tensor.index_select(0, index[i : i + per_chunk]))
        for i in range(0, int(index.numel()), per_chunk)
    ]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.uint64)


def _host_checksums(pages: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint64]:
    words = np.ascontiguousarray(pages).reshape(pages.shape[0], -1).view(np.uint64)
    return words @ _weights(words.shape[1])


def _torch_checksums(pages: Any) -> npt.NDArray[np.uint64]:
    import torch

    words = pages.contiguous().view(pages.shape[0], -1).view(torch.int64)
    w = torch.from_numpy(_weights(words.shape[1]).view(np.int64).copy()).to(words.device)
    sums = (words * w).sum(dim=1)
    result: npt.NDArray[np.uint64] = sums.cpu().numpy().view(np.uint64)
    return result
