"""The KV-transfer hook: how a transfer layer (NIXL) moves a prompt's KV pages from a prefill
engine's buffer into a decode engine's buffer, and lets decode continue.

The engines do not move bytes themselves; they only expose where the pages are and when they may
be touched. For a request ``req`` with ``req.bootstrap_info`` set (any host but
``FAKE_BOOTSTRAP_HOST``)::

    # decode worker                                   # prefill worker
    stream = decode.generate(req)                     out = [o async for o in prefill.generate(req)]
    dst = await decode.wait_transfer_target(rid)      src = await prefill.wait_transfer_source(rid)
                 # ... the transfer layer WRITEs src.block_ids -> dst.block_ids, page i to page i,
                 #     using kv_memory(rank) of each side (address + block_id * block_bytes) ...
    decode.complete_transfer(rid)                     prefill.release_transfer(rid)
    async for out in stream: ...                      # (or fail_transfer(rid, why) on decode)

- ``wait_transfer_target``: returns once the decode scheduler admitted the request and allocated
  fresh blocks for its prompt (it holds a running slot meanwhile, like SGLang's pre-allocation).
- ``wait_transfer_source``: returns once the prefill finished (its stream has ended with one token
  and ``disaggregated_params``); the blocks stay referenced ("owed") until ``release_transfer``,
  ``abort`` or ``transfer_timeout_s``, and ``is_quiescent`` is false meanwhile.
- ``complete_transfer``: decode verifies every page against the prompt (chained page hashes, the
  trailing partial page included); on success the pages enter its prefix cache (``BlockStored``)
  and decoding continues, with the first token recomputed deterministically (it equals the one the
  prefill produced); on a mismatch the stream raises :class:`protocols.errors.KVCorrupted`.
  ``complete_transfers`` does it for several requests (those whose KV arrived together) in one
  pass over all their pages. What the pages must hold is worked out from the tokens at the step
  loop's turn after the admission, while the transfer is in flight.
- Both sides number pages the same way: page ``i`` holds prompt tokens ``[i*bs, (i+1)*bs)``.

Live migration reuses both halves: a draining decode worker's ``hand_over`` (at a step
boundary, every request at once) plays the prefill side (its pages owed until
``release_transfer``), and the next decode worker receives them for a ``live_migration``
request, admitted at once or failed (``KVTransferError``), never queued.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import msgspec

from actors.serving.engines._mock._kvmem import KvPageMemory
from actors.serving.engines._mock._pages import expected_kv
from actors.serving.engines._mock._request import ExpectedKV, MockRequest, Phase
from actors.serving.engines._mock._scheduler import RankScheduler
from actors.serving.engines._mock._tokens import TokenModel
from protocols.engine import BootstrapInfo, FinishReason
from protocols.errors import KVTransferError

__all__ = ["KvPages", "Offer", "TransferMixin"]

Offer = Callable[[dict[str, int]], Mapping[str, BootstrapInfo]]
"""``offer(planned)``: a drain's rooms for the requests it hands over, given how many tokens
each one's KV will cover (see ``MockEngine.hand_over``)."""


class KvPages(msgspec.Struct, frozen=True, kw_only=True):
    """The pages of one request's prompt KV on one side of a transfer."""

    rid: str
    dp_rank: int
    block_ids: tuple[int, ...]  # page i of the prompt lives in block_ids[i]
    num_tokens: int  # prompt tokens covered (the last page may be partial)
    block_size: int
    block_bytes: int
    memory_generation: int  # KvMemoryInfo.generation the block ids refer to
    # A hand-over's: the token model's hash of the tokens the pages hold (the mock's stand-in
    # for the KV's state), so the next engine starts from it without hashing a long context.
    prefix_hash: int | None = None

    def byte_offsets(self) -> list[int]:
        """Byte offset of each page within its rank's KV buffer."""
        return [b * self.block_bytes for b in self.block_ids]


class TransferMixin:
    """The transfer-hook methods of ``MockEngine``."""

    _ranks: list[RankScheduler]
    _memories: list[KvPageMemory]
    _tokens: TokenModel

    def _find(self, rid: str) -> MockRequest | None:
        raise NotImplementedError

    def _pages(
        self, req: MockRequest, tokens: int | None = None, prefix_hash: int | None = None
    ) -> KvPages:
        memory, cfg = self._memories[req.rank], self._ranks[req.rank].cfg
        tokens = req.prompt_len if tokens is None else tokens
        return KvPages(
            rid=req.rid,
            dp_rank=req.rank,
            block_ids=tuple(req.blocks[: cfg.blocks_for(tokens)]),
            num_tokens=tokens,
            block_size=cfg.block_size,
            block_bytes=memory.block_bytes,
            memory_generation=memory.generation,
            prefix_hash=prefix_hash,
        )

    def _expecting(self, rid: str) -> MockRequest:
        req = self._find(rid)
        if req is None or req.transfer_ready is None:
            raise KVTransferError(f"{rid}: no KV transfer pending for this request")
        return req

    async def wait_transfer_target(self, rid: str) -> KvPages:
        """Decode side: the blocks the prompt's pages must be written to."""
        req = self._expecting(rid)
        assert req.transfer_ready is not None
        if not req.transfer_ready.is_set():  # a live migration's is (admitted at once)
            await req.transfer_ready.wait()
        if req.phase is not Phase.AWAITING_KV:
            raise KVTransferError(f"{rid}: the request ended before its KV arrived")
        return self._pages(req)

    def complete_transfer(
        self, rid: str, *, overlap: bool = False, prefix_hash: int | None = None
    ) -> bool:
        """Decode side: the pages are written; verify them and continue decoding.

        Returns whether they verified; a failure ends the stream with ``KVCorrupted``. For
        ``overlap`` and ``prefix_hash`` see :meth:`complete_transfers`.
        """
        req = self._expecting(rid)
        if req.phase is not Phase.AWAITING_KV:
            raise KVTransferError(f"{rid}: not waiting for KV (phase {req.phase.value})")
        hashes = None if prefix_hash is None else {rid: prefix_hash}
        return self.complete_transfers([rid], overlap=overlap, prefix_hashes=hashes)[rid]

    def complete_transfers(
        self,
        rids: Sequence[str],
        *,
        overlap: bool = False,
        prefix_hashes: Mapping[str, int] | None = None,
    ) -> dict[str, bool]:
        """:meth:`complete_transfer` for every request of ``rids`` whose KV arrived (a drain's
        live migrations landing together): all their pages verified in one pass, against what
        the step loop worked out from their tokens while the KV was on its way (or now, if it
        had no turn since). A request that is no longer waiting for its KV (it ended meanwhile)
        is left out.

        With ``overlap`` a request that goes on decoding starts at once and its pages are
        checked while its first step runs (see ``_received``): ``True`` then says it started,
        and a failed check ends its stream with ``KVCorrupted`` before that step's tokens. One
        that ends at once (its first token stops it) is checked first, as without.

        ``prefix_hashes``: the token model's hash of a request's tokens as the KV came with it
        (:attr:`KvPages.prefix_hash`, a hand-over's): it starts from that, without hashing its
        context first, and the check fails it if its tokens hash otherwise.
        """
        reqs = [r for r in map(self._find, rids) if r is not None and r.phase is Phase.AWAITING_KV]
        given = prefix_hashes or {}
        results: dict[str, bool] = {}
        for rank, sched in enumerate(self._ranks):
            mine = [r for r in reqs if r.rank == rank]
            if not mine:
                continue
            bs = sched.cfg.block_size
            # What each must hold (unless the check works it out later) and the hash it
            # starts from.
            expected: list[ExpectedKV | None] = []
            starts: list[int] = []
            for r in mine:
                exp, h = r.expected, given.get(r.rid)
                if h is None or (exp is None and not overlap):
                    exp = exp or expected_kv(r, bs, self._tokens)
                    h = exp.prefix_hash if h is None else h
                expected.append(exp)
                starts.append(h)
            firsts = [self._first(sched, r, h) for r, h in zip(mine, starts, strict=True)]
            later = [overlap and _decodes_on(r, f) for r, f in zip(mine, firsts, strict=True)]
            now = [i for i, wait in enumerate(later) if not wait]
            passed = sched.received.check_now(
                [mine[i] for i in now],
                [expected[i] or expected_kv(mine[i], bs, self._tokens) for i in now],
                [given.get(mine[i].rid) for i in now],
            )
            ok = dict(zip(now, passed, strict=True))
            for i, (req, h, first) in enumerate(zip(mine, starts, firsts, strict=True)):
                if later[i]:
                    sched.received.check_later(req, expected[i], given.get(req.rid))
                elif not ok[i]:
                    results[req.rid] = False
                    continue
                req.expected = None
                self._start(sched, req, h, first)
                results[req.rid] = True
        return results

    def _first(
        self, sched: RankScheduler, req: MockRequest, prefix_hash: int
    ) -> tuple[int, FinishReason | None] | None:
        """The token ``req`` recomputes first from its received KV (of hash ``prefix_hash``)
        and whether it stops there (``None``: it may produce no more)."""
        if req.ngen >= req.max_new:
            return None
        regular, eos = self._tokens.next_token(prefix_hash, req.seed_word)
        return sched.decide(req, regular, eos, req.ngen, prefix_hash)

    def _start(
        self,
        sched: RankScheduler,
        req: MockRequest,
        prefix_hash: int,
        first: tuple[int, FinishReason | None] | None,
    ) -> None:
        """Decode ``req`` from its received KV (or end it, if it may produce no more)."""
        req.kv_len = req.prompt_len
        sched.kv_received_tokens += req.prompt_len
        req.bootstrap = None  # from now on a retraction re-prefills locally
        if first is None:
            sched.end(req, "length")
            return
        sched.start_decoding(req, prefix_hash, *first)
        if req.request.live_migration:
            sched.arrived(req)
        # Its pages' KV events go out with those of the other live migrations arriving in this
        # turn (one batch per drain, not one send each), at the step loop's next turn.
        sched.after_change(publish=not req.request.live_migration)

    def hold_blocks(self, pages: KvPages) -> Callable[[], None]:
        """Decode side: keep ``pages``' blocks in use after their request ends (a failed
        transfer's, which a WRITE may still reach: the transfer layer holds them) until the
        returned function is called."""
        sched = self._ranks[pages.dp_rank]
        resets = sched.pool.retain(pages.block_ids)

        def release() -> None:
            sched.pool.release_retained(pages.block_ids, resets)
            sched.wake()  # a request may be waiting for blocks

        return release

    def fail_transfer(self, rid: str, message: str) -> None:
        """Decode side: the transfer failed; the stream raises ``KVTransferError(message)``."""
        req = self._find(rid)
        if req is not None:
            self._ranks[req.rank].end(req, error=KVTransferError(message))

    async def wait_transfer_source(self, rid: str) -> KvPages:
        """Prefill side: the blocks holding the prompt's pages, once the prefill has finished."""
        req = self._expecting(rid)
        assert req.transfer_ready is not None
        await req.transfer_ready.wait()
        if req.phase is not Phase.OWED:
            raise KVTransferError(f"{rid}: the prefill ended without KV to transfer")
        return self._pages(req)

    async def hand_over(
        self, rids: Sequence[str], offer: Offer | None = None
    ) -> dict[str, KvPages | None]:
        """Decode side of a live migration (a drain): stop decoding ``rids`` and keep their KV
        for the next decode worker.

        It happens at a step boundary: a step in flight completes first (its tokens are
        delivered, its work is not thrown away) and no step starts until every request is
        handed over. Returns each request's pages, or ``None`` for one that is not decoding
        when this is called (abort it for a replay); a request that ended meanwhile (its step
        in flight finished it, or it was aborted) is left out.

        ``offer``, if given, is called at once (before the step in flight ends) with how many
        tokens of each decoding request's sequence its pages will cover; where it answers with
        a room, the request's stream hands out an offer (``disaggregated_params`` and
        ``handover_tokens``) before any more tokens, so the next worker can get ready meanwhile.

        Each stream ends ``cancelled``, after every token so far. The pages cover the sequence
        but its newest token (``num_tokens``; the trailing partial page is written), so the next
        worker receives them for a request of that prefix and recomputes the newest token as its
        first (from :attr:`KvPages.prefix_hash`, which the pages carry). They stay owed until
        ``release_transfer``, ``abort`` or ``transfer_timeout_s``.
        """
        for sched in self._ranks:
            sched.hold()
        try:
            planned: dict[str, int] = {}
            others: list[str] = []
            for rid in rids:
                req = self._find(rid)
                if req is not None and req.phase is Phase.DECODE:
                    planned[rid] = self._ranks[req.rank].covered_at_boundary(req)
                else:
                    others.append(rid)
            if offer is not None and planned:
                for rid, bootstrap in offer(planned).items():
                    req = self._find(rid)
                    if req is not None and not req.done:
                        req.offer = (bootstrap, planned[rid])
                        req.wake()
            for sched in self._ranks:
                await sched.wait_step_boundary()
            found = {rid: self._find(rid) for rid in planned}
            handed = {
                rid: r for rid, r in found.items() if r is not None and r.phase is Phase.DECODE
            }
            covered: dict[str, int] = {}  # the hash of the tokens each one's KV holds
            for rank, sched in enumerate(self._ranks):
                mine = [r for r in handed.values() if r.rank == rank]
                if mine:
                    # All at once: one write of their partial pages.
                    covered.update(sched.hand_over(mine))
            out: dict[str, KvPages | None] = {
                rid: self._pages(req, req.kv_len, covered[rid]) for rid, req in handed.items()
            }
            for rid in others:
                req = self._find(rid)
                if req is not None and req.phase is not Phase.FINISHED:
                    out[rid] = None
            return out
        finally:
            for sched in self._ranks:
                sched.release_hold()

    def release_transfer(self, rid: str) -> None:
        """Prefill side: the decode side has the pages; free them (they stay prefix-cached)."""
        req = self._find(rid)
        if req is not None and req.phase is Phase.OWED:
            self._ranks[req.rank].end(req)


def _decodes_on(req: MockRequest, first: tuple[int, FinishReason | None] | None) -> bool:
    """Whether ``req`` goes on decoding after ``first``, the token it recomputes first."""
    return first is not None and first[1] is None and req.ngen + 1 < req.max_new
