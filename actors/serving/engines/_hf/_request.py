"""The async side of one request: validation into a core ``Seq``, and its output stream."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import torch

from protocols.engine import EngineOutput, PreprocessedRequest
from protocols.errors import ContextLengthExceeded, InvalidRequest, RequestError

from .._grammar import Vocabulary, generated_tail
from ._batch import Seq
from ._kv import KVLayout
from ._sampling import LogitBias, SamplingParams

__all__ = ["Limits", "RequestStream", "build_seq"]


@dataclass(frozen=True)
class Limits:
    """What a request is checked against (known once the model is loaded)."""

    context_length: int
    total_pages: int
    layout: KVLayout
    vocab_size: int
    eos_token_ids: frozenset[int]  # the model's own
    device: torch.device
    vocabulary: Callable[[], Vocabulary]  # the tokenizer's, for grammars (made on first use)


def build_seq(request: PreprocessedRequest, limits: Limits) -> Seq:
    """Check ``request`` (typed errors, nothing run) and resolve its limits and sampling."""
    prompt = list(request.token_ids)
    if not prompt:
        raise InvalidRequest("the prompt has no tokens")
    if min(prompt) < 0 or max(prompt) >= limits.vocab_size:
        raise InvalidRequest("a prompt token id is outside the vocabulary")
    opts = request.sampling_options
    if not 0 <= request.generated < len(prompt):
        raise InvalidRequest("generated must count tokens of token_ids after the first")
    bias = None
    if opts.logit_bias:
        if min(opts.logit_bias) < 0 or max(opts.logit_bias) >= limits.vocab_size:
            raise InvalidRequest("a logit_bias token id is outside the vocabulary")
        bias = LogitBias.from_options(opts.logit_bias)
    grammar = None
    if opts.guided_decoding is not None:
        grammar = limits.vocabulary().matcher(opts.guided_decoding, generated_tail(request))
    stop = request.stop_conditions
    context = limits.context_length
    room = context - len(prompt)
    if room < 1:
        raise ContextLengthExceeded(f"a prompt of {len(prompt)} tokens fills the context {context}")
    max_tokens = room if stop.max_tokens is None else stop.max_tokens
    if max_tokens < 1:
        raise InvalidRequest("max_tokens must be at least 1")
    if max_tokens > room:
        raise ContextLengthExceeded(
            f"{len(prompt)} prompt + {max_tokens} new tokens exceed the context length {context}"
        )
    if limits.layout.pages_needed(len(prompt) + max_tokens) > limits.total_pages:
        raise ContextLengthExceeded("the request needs more KV than the whole cache holds")
    eos = set() if stop.ignore_eos else set(request.eos_token_ids) | limits.eos_token_ids
    return Seq(
        rid=request.rid,
        prompt=prompt,
        params=SamplingParams.from_options(opts),
        max_tokens=max_tokens,
        min_tokens=stop.min_tokens or 0,
        stop_ids=frozenset(eos | set(stop.stop_token_ids or ())),
        generator=torch.Generator(device=limits.device),
        logprobs=request.logprobs,
        prior=request.generated,
        grammar=grammar,
        bias=bias,
        prompt_logprobs=request.prompt_logprobs,
    )


@dataclass(eq=False)
class RequestStream:
    """Items for one request, pushed on the event loop thread, read by its ``generate``."""

    items: deque[EngineOutput | RequestError] = field(default_factory=deque)
    event: anyio.Event | None = None

    def push(self, item: EngineOutput | RequestError) -> None:
        """Add an item and wake the reader."""
        self.items.append(item)
        if self.event is not None:
            self.event.set()

    async def get(self) -> EngineOutput | RequestError:
        """The next item, waiting for it."""
        while not self.items:
            self.event = anyio.Event()
            await self.event.wait()
        return self.items.popleft()
