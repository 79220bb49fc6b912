"""The page allocator behind :class:`~actors.serving.kv.KVPool`: free pages as sorted runs.

Best fit keeps long runs for long requests, so a request's pages are contiguous whenever the
pool has a long enough free run, and then move as one NIXL descriptor.
"""

from __future__ import annotations

import bisect

import numpy as np
import numpy.typing as npt

__all__ = ["Extents", "runs"]

PageArray = npt.NDArray[np.int64]


class Extents:
    """Free pages as sorted, disjoint ``[start, start + length)`` runs."""

    def __init__(self, num_pages: int) -> None:
        self.starts: list[int] = [0] if num_pages else []
        self.lengths: dict[int, int] = {0: num_pages} if num_pages else {}
        self.free = num_pages

    def take(self, n: int) -> PageArray:
        # Best fit: the smallest run that holds all n pages keeps big runs for big requests.
        best = -1
        for start in self.starts:
            length = self.lengths[start]
            if length >= n and (best < 0 or length < self.lengths[best]):
                best = start
                if length == n:
                    break
        if best >= 0:
            self._cut(best, best, n)
            return np.arange(best, best + n, dtype=np.int64)
        # Fragmented: gather the largest runs first, so the request has the fewest runs.
        out: list[PageArray] = []
        need = n
        for start in sorted(self.starts, key=lambda s: -self.lengths[s]):
            k = min(need, self.lengths[start])
            out.append(np.arange(start, start + k, dtype=np.int64))
            self._cut(start, start, k)
            need -= k
            if not need:
                break
        return np.sort(np.concatenate(out))

    def claim(self, first: int, count: int) -> bool:
        """Take exactly ``[first, first + count)`` if it is entirely free."""
        i = bisect.bisect_right(self.starts, first) - 1
        if i < 0:
            return False
        start = self.starts[i]
        if first + count > start + self.lengths[start]:
            return False
        self._cut(start, first, count)
        return True

    def _cut(self, start: int, first: int, count: int) -> None:
        length = self.lengths.pop(start)
        self.starts.remove(start)
        if first > start:
            self._insert(start, first - start)
        end = start + length
        if first + count < end:
            self._insert(first + count, end - first - count)
        self.free -= count

    def _insert(self, start: int, length: int) -> None:
        bisect.insort(self.starts, start)
        self.lengths[start] = length

    def give(self, first: int, count: int) -> None:
        i = bisect.bisect_left(self.starts, first)
        prev = self.starts[i - 1] if i > 0 else None
        nxt = self.starts[i] if i < len(self.starts) else None
        if (prev is not None and prev + self.lengths[prev] > first) or (
            nxt is not None and first + count > nxt
        ):
            raise ValueError(f"pages {first}..{first + count - 1} freed twice")
        self.free += count
        # Merge with the run before and the run after when they touch.
        if prev is not None and prev + self.lengths[prev] == first:
            first, count = prev, count + self.lengths.pop(prev)
            self.starts.pop(i - 1)
            i -= 1
        if nxt is not None and first + count == nxt:
            count += self.lengths.pop(nxt)
            self.starts.pop(i)
        self._insert(first, count)

    def largest(self) -> int:
        return max(self.lengths.values(), default=0)


def runs(pages: PageArray) -> list[tuple[int, int]]:
    """``(first, count)`` runs of consecutive indices, in the given order."""
    n = int(pages.size)
    if n == 0:
        return []
    # Index lists, not arrays, past the one numpy pass: a request's pages are usually one run
    # or a few, and a dozen small numpy calls cost more than the pass (a live migration's
    # receiver claims and frees a context's pages for every request of a drain). The
    # subtraction and ``nonzero`` themselves: ``np.diff`` and ``np.flatnonzero`` are Python
    # wrappers costing more than their work here.
    breaks = (pages[1:] - pages[:-1] != 1).nonzero()[0]
    if not breaks.size:
        return [(int(pages[0]), n)]
    starts = [0, *(breaks + 1).tolist()]
    ends = [*starts[1:], n]
    return [(int(pages[a]), b - a) for a, b in zip(starts, ends, strict=True)]
