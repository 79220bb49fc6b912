"""One request's state inside the mock engine, and the stream ``generate`` hands out.

The scheduler appends generated tokens to ``seq`` and wakes the stream's waiter; the stream hands
out ``seq[delivered:]`` as one :class:`EngineOutput`, so a consumer that falls behind receives
several tokens at once (SGLang's incremental streaming) instead of one wake-up per token. A
block-diffusion request (``dllm``) hands out whole blocks instead (``_dllm``).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, NamedTuple, Protocol, Self

import anyio

from protocols.engine import (
    BootstrapInfo,
    EngineOutput,
    FinishReason,
    PreprocessedRequest,
    TokenLogprob,
    Usage,
)
from protocols.errors import RequestError

from ._tokens import TokenModel

if TYPE_CHECKING:
    from ._dllm import DllmState
    from ._steer import Steering

__all__ = ["EngineStream", "ExpectedKV", "MockRequest", "Phase", "StreamHost"]


class Phase(enum.Enum):
    WAITING = "waiting"  # queued (also: retracted, to be re-prefilled)
    PREFILL = "prefill"  # admitted: KV allocated, prefill chunks running
    DECODE = "decode"  # in the decode batch
    AWAITING_KV = "awaiting_kv"  # decode role: KV allocated, waiting for the transfer
    OWED = "owed"  # prefill role: finished, KV held until the transfer is done
    FINISHED = "finished"


class ExpectedKV(NamedTuple):
    """What a request's received prompt KV must hold, worked out from its tokens: the decode
    side does it while the transfer is in flight, so the KV's arrival only compares pages."""

    prompt: list[int]
    hashes: list[int]  # chained hashes of every page, the trailing partial one included
    prefix_hash: int  # the token model's hash of the whole prompt (the first token's input)


class MockRequest:
    """Everything the scheduler tracks about one request (a plain, slotted record)."""

    __slots__ = (
        "blocks",
        "bootstrap",
        "cached_tokens",
        "deadline",
        "delivered",
        "disagg_params",
        "dllm",
        "error",
        "expected",
        "finish_reason",
        "hashes",
        "kv_len",
        "max_new",
        "min_new",
        "ngen",
        "offer",
        "phase",
        "prompt_len",
        "prompt_logprobs_due",
        "rank",
        "request",
        "rid",
        "seed_word",
        "seq",
        "slot",
        "steer",
        "stop",
        "transfer_ready",
        "waiter",
        "was_admitted",
    )

    def __init__(
        self,
        request: PreprocessedRequest,
        rank: int,
        *,
        max_new: int,
        min_new: int,
        stop: frozenset[int],
        seed_word: int,
        bootstrap: BootstrapInfo | None,
    ) -> None:
        self.request = request
        self.rid = request.rid
        self.rank = rank
        self.seq: list[int] = list(request.token_ids)
        self.prompt_len = len(self.seq)
        # The engine computed the prompt (no KV received for it): its first output carries the
        # prompt's logprobs when asked for.
        self.prompt_logprobs_due = request.prompt_logprobs is not None
        self.max_new = max_new
        self.min_new = min_new
        self.stop = stop
        self.seed_word = seed_word
        self.bootstrap = bootstrap  # set only when a real KV transfer is involved
        self.phase = Phase.WAITING
        self.ngen = 0
        self.kv_len = 0  # tokens whose KV is computed (and held in ``blocks``)
        self.blocks: list[int] = []
        self.hashes: list[int] = []  # chained hashes of the full pages of ``seq`` computed so far
        self.slot = -1
        self.steer: Steering | None = None  # a grammar, logit_bias or penalties choose tokens
        self.dllm: DllmState | None = None  # a block-diffusion model's: tokens go out in blocks
        self.cached_tokens = 0
        self.was_admitted = False
        self.delivered = len(self.seq)  # seq[:delivered] is prompt or handed to the stream
        self.disagg_params: BootstrapInfo | None = None  # echoed on a prefill's last output
        # A drain's offer of this request's KV (where, how many tokens), for its stream to hand
        # out before any more tokens: see ``MockEngine.hand_over``.
        self.offer: tuple[BootstrapInfo, int] | None = None
        self.finish_reason: FinishReason | None = None
        self.error: RequestError | None = None
        self.waiter: anyio.Event | None = None
        self.transfer_ready: anyio.Event | None = None
        self.expected: ExpectedKV | None = None  # decode role, awaiting KV: see ExpectedKV
        self.deadline = 0.0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @property
    def holding(self) -> bool:
        """A live migration's first token (the newest before the hand-over, recomputed) waits
        for the next one: its consumer has it already, so alone it would be an output sent,
        received and dropped, for every request of a drain while their KV is still landing."""
        return self.ngen == 1 and self.request.live_migration

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            waiter.set()

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_len,
            completion_tokens=self.ngen,
            cached_tokens=self.cached_tokens,
        )


class StreamHost(Protocol):
    """What a stream needs from its rank's scheduler."""

    tokens: TokenModel

    def sync(self, req: MockRequest) -> None: ...

    def park(self, req: MockRequest) -> anyio.Event: ...

    def end(self, req: MockRequest) -> None: ...

    def end_later(self, req: MockRequest) -> None: ...


class EngineStream:
    """The async iterator ``MockEngine.generate`` returns.

    Closing it (``aclose``) before the end aborts the request; so does dropping it unfinished
    (the abort is then deferred to the scheduler, as a finaliser may run at any point).
    Typed errors (``KVCorrupted``, ``KVTransferError``, ``EngineShutdown``, ``InvalidRequest``)
    are raised after the tokens generated before them were handed out.
    """

    def __init__(
        self, req: MockRequest | None, host: StreamHost | None, error: RequestError | None = None
    ) -> None:
        self._req = req
        self._host = host
        self._error = error
        self._closed = False

    @property
    def rid(self) -> str | None:
        return self._req.rid if self._req is not None else None

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> EngineOutput:
        req, host = self._req, self._host
        if self._closed:
            raise StopAsyncIteration
        if req is None or host is None:
            self._closed = True
            assert self._error is not None
            raise self._error
        host.sync(req)
        dllm = req.dllm
        if dllm is not None and dllm.empty_now(req.delivered - req.prompt_len):
            return EngineOutput()  # fault injection: a block that never came (see _dllm)
        while (not _due(req) or req.holding) and not req.done:
            if req.offer is not None:
                break
            await host.park(req).wait()
            host.sync(req)
        if req.offer is not None:
            return _with_prompt_logprobs(req, _offer(req, req.offer, host.tokens), host.tokens)
        tokens, logprobs = _deliver(req, host.tokens)
        if req.error is not None:
            if tokens:
                return _with_prompt_logprobs(
                    req, EngineOutput(token_ids=tokens, logprobs=logprobs), host.tokens
                )
            self._closed = True
            raise req.error
        if req.finish_reason is None or _due(req):
            out = EngineOutput(token_ids=tokens, logprobs=logprobs)
            return _with_prompt_logprobs(req, out, host.tokens)
        self._closed = True
        out = EngineOutput(
            token_ids=tokens,
            finish_reason=req.finish_reason,
            usage=req.usage(),
            disaggregated_params=req.disagg_params,
            logprobs=logprobs,
        )
        return _with_prompt_logprobs(req, out, host.tokens)

    async def aclose(self) -> None:
        """Stop reading; aborts the request if it has not finished."""
        if not self._closed:
            self._closed = True
            if self._req is not None and self._host is not None and not self._req.done:
                self._host.end(self._req)

    def __del__(self) -> None:
        req, host = self._req, self._host
        if not self._closed and req is not None and host is not None and not req.done:
            host.end_later(req)


def _due(req: MockRequest) -> int:
    """How many of the tokens ``req``'s reader has not had yet go out now: all of them, or a
    block-diffusion request's next block (``_dllm``)."""
    pending = len(req.seq) - req.delivered
    return pending if req.dllm is None else req.dllm.due(pending, req.finish_reason)


def _deliver(req: MockRequest, model: TokenModel) -> tuple[list[int], list[TokenLogprob] | None]:
    """The tokens ``req``'s reader has not had yet (that go out now), now delivered, and their
    logprobs if it asked for them."""
    start = req.delivered
    tokens = req.seq[start : start + _due(req)]
    req.delivered += len(tokens)
    top = req.request.logprobs
    return tokens, None if top is None else model.logprobs(tokens, start, top)


def _with_prompt_logprobs(req: MockRequest, out: EngineOutput, model: TokenModel) -> EngineOutput:
    """``out``, with the prompt's logprobs if it is the first output and they are due."""
    if req.prompt_logprobs_due:
        req.prompt_logprobs_due = False
        top = req.request.prompt_logprobs or 0
        out.prompt_logprobs = model.logprobs(req.request.token_ids[1:], 1, top)
    return out


def _offer(req: MockRequest, offer: tuple[BootstrapInfo, int], model: TokenModel) -> EngineOutput:
    """A drain's offer of ``req``'s KV, with the tokens its reader has not had yet (the KV may
    cover them: the next worker is asked for the sequence up to ``handover_tokens``)."""
    req.offer = None
    tokens, logprobs = ([], None) if req.holding else _deliver(req, model)
    bootstrap, covered = offer
    return EngineOutput(
        token_ids=tokens,
        disaggregated_params=bootstrap,
        handover_tokens=covered,
        logprobs=logprobs,
    )
