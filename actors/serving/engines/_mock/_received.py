"""A rank's KV that arrived by a transfer: its pages checked against what they must hold, then
registered in the prefix cache (with their KV events).

The check may wait for the request's first decode step (``complete_transfers(overlap=True)``):
the step loop runs it while that step computes, as a real engine's CPU works while its GPU
does, so a drain's 16 contexts landing together do not hold their first step back for the check
of every page. A request that fails it ends with ``KVCorrupted`` before that step's tokens go
out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from actors.serving.engines._mock._pages import bad_received_pages, expected_kv
from actors.serving.engines._mock._request import ExpectedKV, MockRequest, Phase
from protocols.errors import KVCorrupted

if TYPE_CHECKING:
    from actors.serving.engines._mock._scheduler import RankScheduler

__all__ = ["ReceivedPages"]


class ReceivedPages:
    """The received KV of one rank's requests."""

    def __init__(self, sched: RankScheduler) -> None:
        self._sched = sched
        self._unchecked: list[tuple[MockRequest, ExpectedKV | None, int | None]] = []

    def check_now(
        self,
        reqs: list[MockRequest],
        expected: list[ExpectedKV],
        claimed: list[int | None],
    ) -> list[bool]:
        """Check every page of ``reqs`` in one pass and accept or fail each (see
        :meth:`accept`); returns which passed."""
        if not reqs:
            return []  # (an overlapped completion checks none now: no pass to make)
        bad = bad_received_pages(self._sched.memory, reqs, expected)
        return [self.accept(*args) for args in zip(reqs, expected, bad, claimed, strict=True)]

    def check_later(
        self, req: MockRequest, expected: ExpectedKV | None, claimed: int | None
    ) -> None:
        """``req`` decodes before its pages are checked: :meth:`check_pending` does it (and
        works out what they must hold, if ``expected`` is not known yet)."""
        self._unchecked.append((req, expected, claimed))

    def check_pending(self) -> None:
        """Check the pages :meth:`check_later` left, of the requests still decoding (one that
        ended or was retracted meanwhile no longer holds them)."""
        items = [item for item in self._unchecked if item[0].phase is Phase.DECODE]
        self._unchecked = []
        if items:
            sched = self._sched
            bs = sched.cfg.block_size
            reqs = [r for r, _, _ in items]
            expected = [e or expected_kv(r, bs, sched.tokens) for r, e, _ in items]
            self.check_now(reqs, expected, [c for _, _, c in items])
            sched.after_change(publish=False)  # the caller's turn publishes the events

    def accept(
        self, req: MockRequest, expected: ExpectedKV, bad: list[int], claimed: int | None
    ) -> bool:
        """Register ``req``'s received pages (prefix cache, ``BlockStored``), or end it with
        ``KVCorrupted`` if ``bad`` lists pages that failed the check or the hash its KV came
        with (``claimed``, the token model's stand-in for the KV's state) is not its tokens'."""
        sched = self._sched
        if claimed is not None and claimed != expected.prefix_hash:
            message = "its KV came from another sequence (the state does not match its tokens)"
        elif bad:
            message = (
                f"{len(bad)} of {len(expected.hashes)} KV pages failed verification "
                f"(first: page {bad[0]})"
            )
        else:
            full = req.prompt_len // sched.cfg.block_size
            req.hashes = expected.hashes[:full]
            sched.pool.register_pages(req.blocks[:full], req.hashes, expected.prompt)
            return True
        # Not even the token it recomputed first (checked later, it is queued) goes out: it
        # came from KV that failed.
        req.delivered = len(req.seq)
        sched.end(req, error=KVCorrupted(f"{req.rid}: {message}"))
        return False
