"""The continuous-batching core: sequences, scheduling, one forward pass per step, stops.

Single-threaded by design: only the engine's step thread touches a :class:`BatchCore`; the async
side talks to it through commands (see ``_engine``). Every call returns the deliveries it
produced (outputs, errors, and whether the core let go of the request).

A step schedules running requests first (one decode token each, or the next chunk of a long
prefill), then admits waiting ones while the token budget, the running limit and free KV pages
allow. A request's next input is always ``(prompt + output)[n_cached:]``; that one invariant
covers a fresh prefill, a decode step, a chunked prefill, a request retracted by pause or
preemption (its KV was dropped: it recomputes prompt + output and goes on), and a request whose
prompt KV was imported from a prefill worker.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from protocols.engine import EngineOutput, PauseMode, TokenLogprob, Usage
from protocols.errors import EngineFailure, EngineShutdown, RequestError

from ._attention import BATCH_KWARG, Segment, StepBatch, causal_chunk_mask
from ._kv import PagePool
from ._sampling import SamplingParams, sample

__all__ = ["BatchCore", "Delivery", "Seq"]


@dataclass(eq=False, slots=True)
class Seq:
    """One request inside the core."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    min_tokens: int
    stop_ids: frozenset[int]
    generator: torch.Generator
    prefill_only: bool = False  # disaggregated prefill: draw one token, export the KV, stop
    kv_out: torch.Tensor | None = None  # page buffer a prefill-only request exports into
    kv_out_ids: list[int] | None = None  # ... at these pages of it (None: 0, 1, ...)
    kv_in: torch.Tensor | None = None  # page buffer holding an imported prompt KV
    kv_in_ids: list[int] | None = None  # ... at these pages of it (None: 0, 1, ...)
    logprobs: int | None = None  # the request's (see PreprocessedRequest.logprobs)
    output: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    n_cached: int = 0

    @property
    def n_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.prompt) + len(self.output)

    def usage(self) -> Usage:
        """Usage so far (no prefix reuse, so nothing is ever cached)."""
        return Usage(
            prompt_tokens=len(self.prompt), completion_tokens=len(self.output), cached_tokens=0
        )


@dataclass(frozen=True, slots=True)
class Delivery:
    """An item for a request's stream; ``done`` means the core no longer holds the request."""

    rid: str
    item: EngineOutput | RequestError
    done: bool


class BatchCore:
    """Scheduler + model runner over a :class:`PagePool` (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        pool: PagePool,
        *,
        max_running: int,
        max_batch_tokens: int,
    ) -> None:
        self.model: Any | None = model
        self.pool = pool
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.paused = False
        self.steps = 0
        self.tokens_generated = 0
        self.preemptions = 0  # running requests retracted for lack of KV pages

    # ---- commands ------------------------------------------------------------------------
    def submit(self, seq: Seq) -> list[Delivery]:
        """Queue a request. An imported-KV request whose first token already ends it finishes
        here without running."""
        reason = self._stop_reason(seq) if seq.kv_in is not None else None
        if reason is not None:
            return [self._finish(seq, reason, token_ids=list(seq.output))]
        self.waiting.append(seq)
        return []

    def abort(self, rid: str) -> list[Delivery]:
        """Drop ``rid`` wherever it is, freeing its pages; its stream ends ``cancelled``."""
        for seq in [*self.running, *self.waiting]:
            if seq.rid == rid:
                return [self._finish(seq, "cancelled")]
        return []

    def pause(self, mode: PauseMode) -> list[Delivery]:
        """Stop stepping. ABORT ends every request ``cancelled``, RETRACT frees the KV of running
        ones (they recompute it after ``continue``), IN_PLACE keeps everything."""
        self.paused = True
        if mode is PauseMode.ABORT:  # as SGLang (and the mock engine): the streams end cancelled
            return [self._finish(seq, "cancelled") for seq in [*self.running, *self.waiting]]
        if mode is PauseMode.RETRACT:
            self.retract_all()
        return []

    def continue_generation(self) -> None:
        """Resume stepping after ``pause``."""
        self.paused = False

    def retract_all(self) -> None:
        """Free every running request's KV; they wait at the front of the queue, in order."""
        for seq in reversed(list(self.running)):
            self._retract(seq)

    def shutdown(self) -> list[Delivery]:
        """Fail everything with :class:`EngineShutdown` (migratable) and free all pages."""
        return self.fail_all(EngineShutdown("the engine shut down during generation"))

    @property
    def can_step(self) -> bool:
        """Whether ``step`` would do anything."""
        ready = self.model is not None and self.pool.allocated and not self.paused
        return ready and bool(self.running or self.waiting)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[Delivery]:
        """Schedule, run one forward pass, draw tokens, apply stops."""
        if not self.can_step:
            return []
        out: list[Delivery] = []
        sched = self._schedule(out)
        if not sched:
            return out
        try:
            logits, samplers = self._forward(sched)
        except Exception as exc:  # a failed forward fails the requests in it, not the engine
            err = EngineFailure(f"forward pass failed: {type(exc).__name__}: {exc}")
            return out + [self._drop(seq, err) for seq, _ in sched]
        self.steps += 1
        for seq, n_in in sched:
            seq.n_cached += n_in
        for row, seq in enumerate(samplers):
            banned = seq.stop_ids if len(seq.output) + 1 < seq.min_tokens else frozenset()
            try:
                token, logprob = sample(
                    logits[row],
                    seq.params,
                    prompt=seq.prompt,
                    output=seq.output,
                    banned=sorted(banned),
                    generator=seq.generator,
                    logprobs=seq.logprobs,
                )
            except Exception as exc:  # e.g. parameters that leave nothing to draw from
                err = EngineFailure(f"sampling failed: {type(exc).__name__}: {exc}")
                out.append(self._drop(seq, err))
                continue
            seq.output.append(token)
            self.tokens_generated += 1
            out.append(self._after_token(seq, token, None if logprob is None else [logprob]))
        return out

    def fail_all(self, err: RequestError) -> list[Delivery]:
        """End every request with ``err`` (the step loop met an unexpected error)."""
        return [self._drop(seq, err) for seq in [*self.running, *self.waiting]]

    def _schedule(self, out: list[Delivery]) -> list[tuple[Seq, int]]:
        budget = self.max_batch_tokens
        sched: list[tuple[Seq, int]] = []
        for seq in list(self.running):
            if seq not in self.running:  # preempted below to make room for an earlier one
                continue
            n_in = min(seq.n_tokens - seq.n_cached, budget)
            if n_in <= 0:
                break
            if not self._reserve(seq, seq.n_cached + n_in, preempt=True):
                continue  # it was itself preempted
            sched.append((seq, n_in))
            budget -= n_in
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if seq.kv_in is not None:
                if not self._reserve(seq, seq.n_tokens, preempt=False):
                    break
                n_pages = self.pool.layout.pages_needed(len(seq.prompt))
                self.pool.load(seq.pages[:n_pages], seq.kv_in, seq.kv_in_ids)
                seq.kv_in = seq.kv_in_ids = None
                seq.n_cached = len(seq.prompt)
                # The first token (drawn by the prefill worker) opens the stream, and tells the
                # caller its page buffer is free again.
                out.append(Delivery(seq.rid, EngineOutput(token_ids=list(seq.output)), done=False))
            n_in = min(seq.n_tokens - seq.n_cached, budget)
            if not self._reserve(seq, seq.n_cached + n_in, preempt=False):
                break
            self.waiting.popleft()
            self.running.append(seq)
            sched.append((seq, n_in))
            budget -= n_in
        return sched

    def _reserve(self, seq: Seq, n_tokens: int, *, preempt: bool) -> bool:
        """Give ``seq`` pages for ``n_tokens`` tokens; when short, retract the most recently
        admitted running requests (``preempt``), possibly ``seq`` itself (then False)."""
        need = self.pool.layout.pages_needed(n_tokens) - len(seq.pages)
        while need > self.pool.num_free:
            if not preempt or not self.running:
                return False
            victim = self.running[-1]
            self._retract(victim)
            self.preemptions += 1
            if victim is seq:
                return False
        if need > 0:
            seq.pages.extend(self.pool.alloc(need))
        return True

    def _retract(self, seq: Seq) -> None:
        self.pool.free(seq.pages)
        seq.pages = []
        seq.n_cached = 0
        if seq in self.running:
            self.running.remove(seq)
            self.waiting.appendleft(seq)

    def _forward(self, sched: list[tuple[Seq, int]]) -> tuple[torch.Tensor, list[Seq]]:
        device = self.pool.device
        block = self.pool.layout.block_size
        ids: list[int] = []
        positions: list[int] = []
        page_idx: list[int] = []
        segments: list[Segment] = []
        keep: list[int] = []
        samplers: list[Seq] = []
        for seq, n_in in sched:
            start = len(ids)
            tokens = seq.prompt + seq.output
            ids.extend(tokens[seq.n_cached : seq.n_cached + n_in])
            pos = range(seq.n_cached, seq.n_cached + n_in)
            positions.extend(pos)
            page_idx.extend(seq.pages[p // block] for p in pos)
            mask = None
            if seq.n_cached and n_in > 1:  # a chunk after cached tokens needs an explicit mask
                mask = causal_chunk_mask(seq.n_cached, n_in, device)
            pages = torch.tensor(seq.pages, dtype=torch.long, device=device)
            segments.append(Segment(start, len(ids), seq.n_cached, pages, mask))
            if seq.n_cached + n_in == seq.n_tokens:  # reached the end: draw the next token
                keep.append(len(ids) - 1)
                samplers.append(seq)
        pos_t = torch.tensor(positions, dtype=torch.long, device=device)
        batch = StepBatch(
            pool=self.pool,
            page_idx=torch.tensor(page_idx, dtype=torch.long, device=device),
            slot_idx=pos_t % block,
            segments=tuple(segments),
        )
        keep_t = torch.tensor(keep or [0], dtype=torch.long, device=device)
        with torch.inference_mode():
            result = self.model(  # type: ignore[misc]
                input_ids=torch.tensor([ids], dtype=torch.long, device=device),
                position_ids=pos_t[None],
                use_cache=False,
                logits_to_keep=keep_t,
                **{BATCH_KWARG: batch},
            )
        return result.logits[0].float(), samplers

    # ---- stops and endings ---------------------------------------------------------------
    def _stop_reason(self, seq: Seq) -> str | None:
        last = seq.output[-1]
        if last in seq.stop_ids and len(seq.output) >= seq.min_tokens:
            return "stop"
        if len(seq.output) >= seq.max_tokens:
            return "length"
        return None

    def _after_token(self, seq: Seq, token: int, logprobs: list[TokenLogprob] | None) -> Delivery:
        if seq.prefill_only:
            assert seq.kv_out is not None
            n = len(seq.prompt)
            pages = seq.pages[: self.pool.layout.pages_needed(n)]
            self.pool.export(pages, n, seq.kv_out, seq.kv_out_ids)
            return self._finish(seq, "length", token_ids=[token], logprobs=logprobs)
        reason = self._stop_reason(seq)
        if reason is None:
            return Delivery(seq.rid, EngineOutput(token_ids=[token], logprobs=logprobs), done=False)
        return self._finish(seq, reason, token_ids=[token], logprobs=logprobs)

    def _release(self, seq: Seq) -> None:
        self.pool.free(seq.pages)
        seq.pages = []
        seq.kv_in = seq.kv_out = None
        seq.kv_in_ids = seq.kv_out_ids = None
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)

    def _finish(
        self,
        seq: Seq,
        reason: str,
        token_ids: Sequence[int] = (),
        logprobs: list[TokenLogprob] | None = None,
    ) -> Delivery:
        if seq in self.running or seq in self.waiting:
            self._release(seq)
        out = EngineOutput(
            token_ids=list(token_ids),
            finish_reason=reason,  # type: ignore[arg-type]
            usage=seq.usage(),
            logprobs=logprobs,
        )
        return Delivery(seq.rid, out, done=True)

    def _drop(self, seq: Seq, err: RequestError) -> Delivery:
        self._release(seq)
        return Delivery(seq.rid, err, done=True)
