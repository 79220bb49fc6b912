"""Block diffusion (``kind="dllm"``): the mock's text in blocks of several tokens.

A block-diffusion model (LLaDA2.0 under SGLang's ``--dllm-algorithm``) denoises a block of
``dllm_block_tokens`` masked positions over ``dllm_rounds`` rounds and only then streams it. The
mock keeps its scheduler and its token rule, so the text is the chat mock's token for token (and
a continuation after a migration goes on exactly); it changes two things:

- **Emission**: a stream hands out whole blocks, one per output, counted from the request's first
  generated token. The last block may be shorter: max_tokens, EOS or a stop token end the request
  inside a block, as the token rule gives. A request that ends any other way (an abort, an error)
  drops its unfinished block: it was never denoised.
- **Timing**: each token costs ``dllm_rounds / dllm_block_tokens`` of a decode pass, so a block
  costs ``dllm_rounds`` passes (the first block's first token comes with the prefill's step).

A migrated request's prompt carries the blocks already sent (whole blocks only): the next worker
re-does the block in progress, and its blocks line up with the first attempt's.

``dllm_empty_chunk_after`` (fault injection) makes a request's first attempt send, right after
that many blocks, one output with neither tokens nor a finish: the output a request stream of a
dllm model treats as a migratable error (``EmptyOutput``).
"""

from __future__ import annotations

from actors.serving.engines._mock._config import MockEngineConfig
from protocols.engine import FinishReason, PreprocessedRequest

__all__ = ["DllmState", "dllm_state", "step_seconds"]


class DllmState:
    """How one dllm request's stream hands out its tokens (``MockRequest.dllm``)."""

    __slots__ = ("block", "empty_after")

    def __init__(self, block: int, empty_after: int | None) -> None:
        self.block = block
        self.empty_after = empty_after  # blocks before the injected empty output, until sent

    def due(self, pending: int, finish: FinishReason | None) -> int:
        """How many of the ``pending`` tokens not yet handed out go out now: one whole block, or
        the rest once the token rule ended the request (the last block, cut short)."""
        if pending >= self.block:
            return self.block
        return pending if finish == "stop" or finish == "length" else 0

    def empty_now(self, sent: int) -> bool:
        """Whether the injected empty output goes out now, after ``sent`` generated tokens were
        handed out (once)."""
        if self.empty_after is None or sent != self.empty_after * self.block:
            return False
        self.empty_after = None
        return True


def dllm_state(cfg: MockEngineConfig, request: PreprocessedRequest) -> DllmState | None:
    """``request``'s block state on an engine of ``cfg`` (``None``: token by token)."""
    if cfg.kind != "dllm":
        return None
    # Only a first attempt: its continuation must succeed, as a real engine's retry would.
    empty = cfg.dllm_empty_chunk_after if request.generated == 0 else None
    return DllmState(cfg.dllm_block_tokens, empty)


def step_seconds(cfg: MockEngineConfig, prefill_tokens: int, decoding: bool, frac: float) -> float:
    """What a step of the scheduler costs on an engine of ``cfg``: the timing model's, with a
    dllm's decode pass (one token per request) charged ``dllm_rounds / dllm_block_tokens``."""
    timing = cfg.timing
    if cfg.kind != "dllm" or not decoding:
        return timing.step_seconds(prefill_tokens, decoding, frac)
    rounds = timing.step_seconds(0, True, frac) * cfg.dllm_rounds / cfg.dllm_block_tokens
    return timing.step_seconds(prefill_tokens, False, frac) + rounds
