"""A request's KV pages: chained hashes of its full pages, and writing their content."""

from __future__ import annotations

from actors.engines._mock._kvmem import KvPageMemory, page_hash
from actors.engines._mock._pool import BlockPool
from actors.engines._mock._request import MockRequest

__all__ = ["fill_pages", "hashes_upto", "write_partial"]


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


def write_partial(req: MockRequest, block_size: int, memory: KvPageMemory) -> None:
    """Write the trailing partial page (a prefill's last), so a transfer can verify it."""
    bs, n = block_size, req.kv_len
    if n % bs:
        p = n // bs
        parent = hashes_upto(req, p, bs)[p - 1] if p else None
        memory.write(req.blocks[p], page_hash(parent, req.seq[p * bs : n]))
