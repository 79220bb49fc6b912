"""Page hashing shared by engines, the KV transfer layer and the KV-aware router.

A page's hash is chained, as SGLang's paged radix cache and Dynamo's KV router name blocks:
xxh3-64 of the page's tokens (as native int64 bytes) seeded with the parent page's hash (0 for
the first page), as a signed 64-bit int (SGLang's ``hash_str_to_int64`` range). It therefore
stands for the whole prefix up to the page's end, position included.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import xxhash

__all__ = ["page_hash", "prompt_page_hashes", "token_bytes"]

_MASK = (1 << 64) - 1
_INT64_MAX = (1 << 63) - 1


def token_bytes(tokens: Sequence[int] | npt.NDArray[np.int64]) -> bytes:
    """The tokens as native int64 bytes (``np.frombuffer(..., np.int64)`` makes them an array).

    struct packs a list of ints ~3x faster than ``array("q", ...)`` or ``np.array`` take it
    (the router hashes every prompt; a live migration's receiver converts a 4k+ context)."""
    if isinstance(tokens, np.ndarray):
        return np.asarray(tokens, dtype=np.int64).tobytes()
    return struct.pack(f"={len(tokens)}q", *tokens)


def page_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The chained hash of one page: a signed 64-bit int (SGLang's ``hash_str_to_int64`` range),
    xxh3-64 of the tokens' int64 bytes seeded with the parent's hash (0 for the first page)."""
    seed = 0 if parent is None else parent & _MASK
    h = xxhash.xxh3_64_intdigest(token_bytes(tokens), seed)
    return h - (1 << 64) if h > _INT64_MAX else h


def prompt_page_hashes(
    tokens: Sequence[int] | npt.NDArray[np.int64], block_size: int, *, partial: bool = True
) -> list[int]:
    """Chained hashes of every page of ``tokens``: full pages, then the partial tail if any.

    The same as :func:`page_hash` page after page, with the tokens converted once (an int64
    array is used as is): a live migration hashes a whole context on the receiving engine."""
    n = len(tokens)
    end = (n if partial else n - n % block_size) * 8
    if isinstance(tokens, np.ndarray):  # its own bytes, not a copy
        data = np.ascontiguousarray(tokens, dtype=np.int64).data.cast("B")[:end]
    else:
        data = memoryview(token_bytes(tokens))[:end]
    step = block_size * 8
    digest = xxhash.xxh3_64_intdigest
    seeds: list[int] = []  # unsigned: each page's hash seeds the next one's
    seed = 0
    for start in range(0, end, step):
        seed = digest(data[start : start + step], seed)
        seeds.append(seed)
    return [h - (1 << 64) if h > _INT64_MAX else h for h in seeds]
