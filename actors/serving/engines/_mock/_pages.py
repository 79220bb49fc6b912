"""A request's KV pages: chained hashes of its full pages, and writing their content."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np

from actors.serving.engines._mock._kvmem import KvPageMemory
from actors.serving.engines._mock._pool import BlockPool
from actors.serving.engines._mock._request import ExpectedKV, MockRequest
from actors.serving.engines._mock._tokens import TokenModel
from protocols.pages import page_hash, prompt_page_hashes, token_bytes

__all__ = ["bad_received_pages", "expected_kv", "fill_pages", "hashes_upto", "write_partials"]


def expected_kv(req: MockRequest, block_size: int, model: TokenModel) -> ExpectedKV:
    """What the KV of ``req``'s prompt must hold (a context may be 4k+ long: converted once,
    hashed page by page, then prefix-hashed as an array)."""
    prompt = req.request.token_ids  # what ``seq`` starts with, not a copy of it
    tokens = np.frombuffer(token_bytes(prompt), dtype=np.int64)
    hashes = prompt_page_hashes(tokens, block_size)
    return ExpectedKV(prompt, hashes, model.prefix_hash(tokens))


def bad_received_pages(
    memory: KvPageMemory, reqs: Sequence[MockRequest], expected: Sequence[ExpectedKV]
) -> list[list[int]]:
    """For each of ``reqs`` (their KV received, ``expected`` what it must hold), the indices of
    its pages that fail: every page of them all checked in one pass."""
    sizes = [len(e.hashes) for e in expected]
    total = sum(sizes)
    # Straight into arrays (the pass takes them): no list of every page on the way.
    parts = [r.blocks[:n] for r, n in zip(reqs, sizes, strict=True)]
    blocks = np.fromiter(chain.from_iterable(parts), np.int64, total)
    hashes = np.fromiter(chain.from_iterable([e.hashes for e in expected]), np.int64, total)
    bad = memory.bad_pages(blocks, hashes)
    out: list[list[int]] = []
    start = 0  # the first of this request's pages in the pass
    for n in sizes:
        out.append([b - start for b in bad if start <= b < start + n])
        start += n
    return out


def hashes_upto(req: MockRequest, pages: int, block_size: int) -> list[int]:
    """``req.hashes`` extended to (at least) its first ``pages`` full pages."""
    seq, hashes, bs = req.seq, req.hashes, block_size
    while len(hashes) < pages:
        p = len(hashes)
        hashes.append(page_hash(hashes[-1] if p else None, seq[p * bs : (p + 1) * bs]))
    return hashes


def fill_pages(
    req: MockRequest, start: int, end: int, block_size: int, memory: KvPageMemory, pool: BlockPool
) -> None:
    """Write and register the pages that became full when the KV grew from start to end."""
    bs = block_size
    first, end_page = start // bs, end // bs
    if first >= end_page:
        return
    hashes = hashes_upto(req, end_page, bs)
    memory.write_pages(req.blocks[first:end_page], hashes[first:end_page])  # one numpy pass
    for p in range(first, end_page):
        pool.register(
            req.blocks[p], hashes[p], hashes[p - 1] if p else None, req.seq[p * bs : (p + 1) * bs]
        )


def write_partials(reqs: Sequence[MockRequest], block_size: int, memory: KvPageMemory) -> None:
    """Write the trailing partial page of each of ``reqs`` (a prefill's last, a handed-over
    sequence's newest), so a transfer can verify it: one write for them all (on a device, one
    copy and one scatter, not one per request on the way to a drain's hand-over)."""
    bs = block_size
    blocks: list[int] = []
    hashes: list[int] = []
    for req in reqs:
        n = req.kv_len
        if n % bs:
            p = n // bs
            parent = hashes_upto(req, p, bs)[p - 1] if p else None
            blocks.append(req.blocks[p])
            hashes.append(page_hash(parent, req.seq[p * bs : n]))
    memory.write_pages(blocks, hashes)
