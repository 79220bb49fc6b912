"""The decode batch of one rank, vectorised over running slots.

While a request decodes, its counters live in per-slot numpy arrays (token hash, seed word, tokens
generated, token budget, KV length, KV capacity) and its new tokens in a per-slot ring. Slots are
handed out lowest first, so the active ones crowd into ``[0, hi)`` and a decode step is ~35 numpy
operations on those views for the whole batch; Python touches a request only on a rare event (a
stop/EOS candidate, a filled page, a block to allocate, the end), or at every step when its
tokens are steered (a grammar, logit_bias, penalties: see ``_steer``). ``sync`` moves ring
tokens into ``req.seq`` and the counters into the request on demand (a reader, a page fill, the
end), so ``MockRequest`` is exact whenever anyone outside this module looks at it.

A step in flight (timed mode) covers the slots active when it was planned: a request that leaves
meanwhile is marked inactive (its slot's arrays are still written, harmlessly: the next owner
re-initialises them), and one that arrives meanwhile (a KV transfer completed) joins after the
commit (``add`` is deferred by the scheduler).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from actors.serving.engines._mock._request import MockRequest, Phase
from actors.serving.engines._mock._tokens import TokenModel
from protocols.engine import FinishReason

__all__ = ["DecodeBatch", "StepEvents"]

Decide = Callable[[MockRequest, int, bool, int, int], tuple[int, FinishReason | None]]

# What a committed step asks the scheduler to do, Python-side: pages to register (req, kv before,
# kv after), requests to finish, requests whose last block is full.
StepEvents = tuple[
    list[tuple[MockRequest, int, int]], list[tuple[MockRequest, FinishReason]], list[MockRequest]
]


class DecodeBatch:
    """Slot arrays and the vectorised decode step."""

    def __init__(self, slots: int, block_size: int, tokens: TokenModel, decide: Decide) -> None:
        self.block_size = block_size
        self.tokens = tokens
        self._decide = decide
        self.size = 0  # requests decoding
        self.hi = 0  # every active slot is below this
        self._by_slot: list[MockRequest | None] = [None] * slots
        self._active = np.zeros(slots, dtype=np.bool_)
        self._steered = np.zeros(slots, dtype=np.bool_)  # chooses its tokens in Python each step
        self._h = np.zeros(slots, dtype=np.uint64)
        self._seed = np.zeros(slots, dtype=np.uint64)
        self._ngen = np.zeros(slots, dtype=np.int64)
        self._max = np.zeros(slots, dtype=np.int64)
        self._kv = np.zeros(slots, dtype=np.int64)
        self._cap = np.zeros(slots, dtype=np.int64)
        # Tokens since the last sync, at ngen % ring; a sync happens at least once per page.
        self._ring_len = 2 * block_size + 2
        self._ring = np.zeros((slots, self._ring_len), dtype=np.int64)
        self._rows = np.arange(slots, dtype=np.intp)
        # How many decoding requests stop on each token id (a lookup instead of set tests).
        self._stops = np.zeros(tokens.vocab_size, dtype=np.int32)
        # While a step is in flight (timed mode) arrivals wait here, so they skip that step.
        self.frozen = False
        self._pending: list[tuple[MockRequest, int]] = []

    def _count_stops(self, req: MockRequest, delta: int) -> None:
        vocab = self.tokens.vocab_size
        for t in req.stop:
            if 0 <= t < vocab:
                self._stops[t] += delta

    def add(self, req: MockRequest, h: int) -> None:
        """``req`` (holding a slot; ``seq`` ends in its newest token, hash ``h``) decodes."""
        req.phase = Phase.DECODE
        if self.frozen:
            self._pending.append((req, h))
            return
        s = req.slot
        self._h[s] = h
        self._seed[s] = req.seed_word
        self._ngen[s] = req.ngen
        self._max[s] = req.max_new
        self._kv[s] = req.kv_len
        self._cap[s] = len(req.blocks) * self.block_size
        self._active[s] = True
        self._steered[s] = req.steer is not None
        self._by_slot[s] = req
        self._count_stops(req, 1)
        self.size += 1
        self.hi = max(self.hi, s + 1)

    def thaw(self) -> None:
        """The step in flight committed: let the requests that arrived meanwhile in."""
        self.frozen = False
        pending, self._pending = self._pending, []
        for req, h in pending:
            if req.phase is Phase.DECODE:
                self.add(req, h)

    def kv_of(self, req: MockRequest) -> int:
        """``req.kv_len`` without a full sync."""
        return int(self._kv[req.slot]) if self.holds(req) else req.kv_len

    def hash_of(self, req: MockRequest) -> int:
        """The token model's hash of ``req``'s sequence (its newest token included)."""
        return int(self._h[req.slot])

    def holds(self, req: MockRequest) -> bool:
        return req.slot >= 0 and self._by_slot[req.slot] is req

    def in_step(self, req: MockRequest) -> bool:
        """Whether the step in flight (if any) samples a token for ``req``: it covers every
        slot active when it was planned, and arrivals since wait in ``_pending``."""
        return self.frozen and self.holds(req)

    def grow(self, req: MockRequest) -> None:
        """``req`` got another block."""
        self._cap[req.slot] = len(req.blocks) * self.block_size

    def sync(self, req: MockRequest) -> None:
        """Bring ``req.seq``, ``req.ngen`` and ``req.kv_len`` up to date from the arrays."""
        if req.phase is not Phase.DECODE or not self.holds(req):
            return  # not decoding, or still pending: ``req`` itself is exact
        s = req.slot
        g = int(self._ngen[s])
        if g > req.ngen:
            ring, k = self._ring[s], g - req.ngen
            start = req.ngen % self._ring_len
            if start + k <= self._ring_len:
                req.seq.extend(ring[start : start + k].tolist())
            else:
                req.seq.extend(np.take(ring, np.arange(start, start + k), mode="wrap").tolist())
            req.ngen = g
        req.kv_len = int(self._kv[s])

    def leave(self, req: MockRequest) -> None:
        """``req`` stops decoding (finish, abort, retraction); it is synced first."""
        if not self.holds(req):
            return  # still pending: ``thaw`` will skip it
        self.sync(req)
        s = req.slot
        self._active[s] = False
        self._steered[s] = False
        self._by_slot[s] = None
        self._count_stops(req, -1)
        self.size -= 1
        while self.hi and not self._active[self.hi - 1]:
            self.hi -= 1

    def commit(self, hi: int) -> tuple[int, StepEvents]:
        """Apply one decode step to the slots below ``hi`` (as planned); returns the number of
        tokens produced and the events."""
        active = self._active[:hi]
        h, ngen, kv = self._h[:hi], self._ngen[:hi], self._kv[:hi]
        regular, eos = self.tokens.next_tokens(h, self._seed[:hi])
        cand = self._stops[regular] > 0
        if eos is not None:
            cand |= eos
        cand |= self._steered[:hi]
        cand &= active
        finished: list[tuple[MockRequest, FinishReason]] = []
        by_slot = self._by_slot
        if cand.any():
            for i in np.flatnonzero(cand).tolist():
                req = by_slot[i]
                assert req is not None
                flag = bool(eos[i]) if eos is not None else False
                token, reason = self._decide(req, int(regular[i]), flag, int(ngen[i]), int(h[i]))
                regular[i] = token
                if reason is not None:
                    finished.append((req, reason))
        self._ring[self._rows[:hi], ngen % self._ring_len] = regular
        ngen += 1
        kv += 1
        self.tokens.extend_in_place(h, regular)
        fills: list[tuple[MockRequest, int, int]] = []
        full: list[MockRequest] = []
        done = ngen >= self._max[:hi]
        page = kv % self.block_size == 0
        need = kv >= self._cap[:hi]
        events = done | page | need
        events &= active
        if events.any():
            stopping = {req.slot for req, _ in finished}
            for i in np.flatnonzero(page & active).tolist():
                req = by_slot[i]
                assert req is not None
                fills.append((req, int(kv[i]) - 1, int(kv[i])))
            for i in np.flatnonzero(done & active).tolist():
                if i not in stopping:
                    req = by_slot[i]
                    assert req is not None
                    finished.append((req, "length"))
                    stopping.add(i)
            for i in np.flatnonzero(need & active).tolist():
                req = by_slot[i]
                if i not in stopping and req is not None:
                    full.append(req)
        return int(np.count_nonzero(active)), (fills, finished, full)
