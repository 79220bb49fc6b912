"""Per-request sampling: greedy, or temperature / top-k / top-p / min-p with penalties and a seed.

Seeded draws are a function of ``(seed, position)`` only: before each draw the request's own
``torch.Generator`` is re-seeded from the seed and the absolute position of the token being
drawn. So a request continues with the same tokens wherever its steps run: on a decode worker
after a prefill worker drew the first token, or on another worker after a migration (which
re-sends prompt + tokens so far, keeping positions), as long as the logits agree.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protocols.engine import SamplingOptions, TokenLogprob

__all__ = ["LogitBias", "SamplingParams", "prompt_logprobs", "sample"]

_MASK64 = (1 << 64) - 1


def _mix(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): well-spread generator seeds for neighbouring positions."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Resolved sampling parameters (SGLang's defaults for what the request leaves out)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0

    @classmethod
    def from_options(cls, opts: SamplingOptions) -> SamplingParams:
        """Resolve a request's options; an unseeded request gets a random seed of its own."""
        seed = opts.seed if opts.seed is not None else int.from_bytes(os.urandom(8), "little")
        return cls(
            temperature=1.0 if opts.temperature is None else float(opts.temperature),
            top_p=1.0 if opts.top_p is None else float(opts.top_p),
            top_k=0 if opts.top_k is None or opts.top_k < 0 else int(opts.top_k),
            min_p=0.0 if opts.min_p is None else float(opts.min_p),
            presence_penalty=float(opts.presence_penalty or 0.0),
            frequency_penalty=float(opts.frequency_penalty or 0.0),
            repetition_penalty=float(opts.repetition_penalty or 1.0),
            seed=seed & _MASK64,
        )

    @property
    def greedy(self) -> bool:
        """Temperature ~0 or top-k 1: argmax, exactly like ``generate(do_sample=False)``."""
        # Below 1e-5 the scaled logits overflow fp32; the distribution is one-hot anyway.
        return self.temperature <= 1e-5 or self.top_k == 1

    @property
    def penalised(self) -> bool:
        """Whether any penalty changes the logits."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )


@dataclass(frozen=True, slots=True)
class LogitBias:
    """A request's ``logit_bias`` as tensors: added to the logits of ``ids``."""

    ids: torch.Tensor  # long
    values: torch.Tensor  # float32

    @classmethod
    def from_options(cls, bias: dict[int, float]) -> LogitBias:
        ids = sorted(bias)
        return cls(
            torch.tensor(ids, dtype=torch.long),
            torch.tensor([float(bias[i]) for i in ids], dtype=torch.float32),
        )


def _apply_penalties(
    logits: torch.Tensor, p: SamplingParams, prompt: Sequence[int], output: Sequence[int]
) -> torch.Tensor:
    vocab = logits.shape[-1]
    if p.repetition_penalty != 1.0:  # transformers' rule, over prompt and output
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long)
        seen = seen[seen < vocab].to(logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(
            vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
        )
    if output and (p.presence_penalty or p.frequency_penalty):  # OpenAI's rule, over output
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab)[:vocab]
        counts = counts.to(device=logits.device, dtype=logits.dtype)
        logits -= counts * p.frequency_penalty + (counts > 0).to(logits.dtype) * p.presence_penalty
    return logits


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    *,
    prompt: Sequence[int],
    output: Sequence[int],
    banned: Sequence[int],
    generator: torch.Generator,
    logprobs: int | None = None,
    bias: LogitBias | None = None,
    allowed: torch.Tensor | None = None,
) -> tuple[int, TokenLogprob | None]:
    """Pick the next token from one request's fp32 ``logits`` (shape ``(vocab,)``), with its
    logprob and the ``logprobs`` most likely tokens' when asked (``None``: not).

    ``prompt`` and ``output`` are the tokens before (the penalties count ``output``'s; the
    position drawn is their total length). ``bias`` is added to the logits after the
    penalties; only ``allowed`` tokens (a bool mask: a grammar's) may be drawn; ``banned``
    tokens get no probability (stop tokens before ``min_tokens``). The logprobs are those of
    the distribution the token is drawn from (as OpenAI and vLLM report): after the penalties,
    the bias, the mask, the temperature and the top-k, top-p and min-p cuts (greedy: before
    the temperature, which argmax ignores).
    """
    logits = logits.clone()  # every change below is in place, on this request's row only
    if params.penalised:
        logits = _apply_penalties(logits, params, prompt, output)
    if bias is not None:
        logits.index_add_(0, bias.ids.to(logits.device), bias.values.to(logits.device))
    if allowed is not None:
        logits.masked_fill_(~allowed.to(logits.device), float("-inf"))
    if banned:
        logits[list(banned)] = float("-inf")
    if params.greedy:
        token = int(torch.argmax(logits))
        if logprobs is None:
            return token, None
        return token, _logprob(torch.log_softmax(logits, dim=-1), token, logprobs)
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_k and params.top_k < probs.shape[-1]:
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs < kth, 0.0, probs)
    if params.min_p > 0.0:
        probs = torch.where(probs < probs.max() * params.min_p, 0.0, probs)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = torch.where(before > params.top_p * sorted_probs.sum(), 0.0, sorted_probs)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    generator.manual_seed(_mix(params.seed, len(prompt) + len(output)))
    token = int(torch.multinomial(probs, 1, generator=generator))
    if logprobs is None:
        return token, None
    return token, _logprob(torch.log(probs / probs.sum()), token, logprobs)


def _logprob(logp: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s entry of the log-distribution ``logp``, with its ``top`` most likely."""
    values, ids = torch.topk(logp, top)
    return TokenLogprob(float(logp[token]), ids.tolist(), values.tolist())


def prompt_logprobs(logits: torch.Tensor, targets: Sequence[int], top: int) -> list[TokenLogprob]:
    """The logprobs of ``targets`` under the model's own distributions ``logits`` (one row
    each: the logits at the position before the target), with the ``top`` most likely."""
    logp = torch.log_softmax(logits, dim=-1)
    return [_logprob(row, token, top) for row, token in zip(logp, targets, strict=True)]
