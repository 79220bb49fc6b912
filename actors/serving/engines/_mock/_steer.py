"""Steering the mock's token function: a grammar, ``logit_bias`` and the penalties.

Unsteered, the token after a sequence of hash ``H`` is the model's *natural* token (its regular
token, or EOS where it emits EOS; see ``_tokens``). A steered request (one with a grammar, a
``logit_bias`` or a non-neutral penalty) chooses instead, deterministically, by pseudo-logits:

- ``z = mix64(H ^ seed word)`` (the word the natural token comes from); every candidate token
  ``t`` scores ``l(t) = 0.9 * u(t)`` with ``u(t) = mix64(z ^ mix64(t + salt)) / 2**64`` in
  ``[0, 1)``, but the natural token scores ``1``: so without any steering effect the choice is
  the natural token, and steering that changes nothing changes no output;
- ``repetition_penalty`` ``r`` divides the score of every token of the prompt or the output
  (scores are never negative: ``r > 1`` demotes them, as transformers' rule does to positive
  logits); ``presence_penalty`` ``p`` and ``frequency_penalty`` ``f`` subtract
  ``p * [count > 0] + f * count`` over the output's tokens (OpenAI's rule);
- ``logit_bias`` ``b`` is added; ``b <= -100`` bans the token outright (OpenAI's "ban"); a bias
  of ``+1`` or more puts a token above every unbiased one, so a large one forces it, and one
  in between shifts it among the others;
- the candidates are the grammar's allowed tokens (every token without a grammar), less the
  request's stop tokens while ``min_tokens`` holds them back, less the banned;
- under a grammar, the tokens that close something (the bytes ``"``, ``}``, ``]``, and the stop
  tokens once the grammar may end) gain ``0.05`` per token the request has produced, so its
  output comes to an end as a real model's would rather than running to ``max_tokens`` (the
  mock's natural token would go on with syllables inside a string for ever);
- the token is the candidate with the highest score (the lowest id among equals).

The output, for the penalties, is the request's own tokens plus the last ``generated`` of its
``token_ids`` (a migrated request's earlier tokens), and its grammar is replayed over those: so a
continuation chooses exactly what the uninterrupted request would have. Once the grammar is
complete and allows nothing more (terminated), the request finishes with ``stop`` on the token
that completed it; if no candidate is left at all, it ends with EOS (``stop``).
"""

from __future__ import annotations

import functools

import numpy as np
import numpy.typing as npt

from actors.serving.engines._grammar import GrammarMatcher, Vocabulary
from actors.serving.engines._mock._tokens import mix64, mix_in_place
from protocols import byte_vocab
from protocols.engine import PreprocessedRequest

__all__ = ["Steering", "mock_vocabulary"]

_SCORE_SALT = 0xA54FF53A5F1D36F1
_NATURAL = 1.0  # the natural token's score: above every unbiased other (they stay below 0.9)
_SPREAD = 0.9
_BAN = -100.0
_CLOSING_GAIN = 0.05  # per token produced
_CLOSERS = tuple(b'"]}')


@functools.lru_cache(maxsize=4)
def mock_vocabulary(vocab_size: int, eos_token_id: int) -> Vocabulary:
    """The mock's vocabulary for the grammar engine: the frontend's byte tokenizer's bytes
    (``protocols.byte_vocab``), its BOS/EOS and the engine's EOS special. One per process and
    shape: building it takes a while and it never changes."""
    special = {byte_vocab.BOS, byte_vocab.EOS, eos_token_id}
    tokens = [
        b"<eos>" if i == eos_token_id else byte_vocab.token_text(i) for i in range(vocab_size)
    ]
    return Vocabulary.from_token_bytes(
        tokens, eos_token_id=eos_token_id, special_ids=[s for s in special if s < vocab_size]
    )


class Steering:
    """One steered request's choice of tokens (see the module docstring)."""

    __slots__ = (
        "_bias_ids",
        "_bias_vals",
        "_closers",
        "_counts",
        "_frequency",
        "_matcher",
        "_presence",
        "_produced",
        "_repetition",
        "_seen",
        "_size",
        "_stop_ids",
        "eos_token_id",
    )

    def __init__(
        self,
        request: PreprocessedRequest,
        *,
        vocab_size: int,
        eos_token_id: int,
        stop: frozenset[int],
        matcher: GrammarMatcher | None,
    ) -> None:
        opts = request.sampling_options
        self._size = vocab_size
        self.eos_token_id = eos_token_id
        self._matcher = matcher
        self._stop_ids = np.array(sorted(t for t in stop if 0 <= t < vocab_size), dtype=np.int64)
        closers = {eos_token_id, *_CLOSERS, *stop}
        self._closers = np.array(sorted(t for t in closers if 0 <= t < vocab_size), np.int64)
        self._produced = request.generated
        bias = {t: float(b) for t, b in (opts.logit_bias or {}).items() if 0 <= t < vocab_size}
        self._bias_ids = np.array(sorted(bias), dtype=np.int64)
        self._bias_vals = np.array([bias[t] for t in sorted(bias)], dtype=np.float64)
        self._presence = float(opts.presence_penalty or 0.0)
        self._frequency = float(opts.frequency_penalty or 0.0)
        self._repetition = float(opts.repetition_penalty or 1.0)
        self._counts = np.zeros(vocab_size, dtype=np.int32)
        self._seen = np.zeros(vocab_size, dtype=np.bool_)
        tokens = np.asarray(request.token_ids, dtype=np.int64)
        tokens = tokens[(tokens >= 0) & (tokens < vocab_size)]
        self._seen[tokens] = True
        if request.generated:
            for token in request.token_ids[-request.generated :]:
                if 0 <= token < vocab_size:
                    self._counts[token] += 1

    @staticmethod
    def wanted(request: PreprocessedRequest) -> bool:
        """Whether ``request`` asks for anything that steers its tokens."""
        opts = request.sampling_options
        return bool(
            opts.guided_decoding is not None
            or opts.logit_bias
            or opts.presence_penalty
            or opts.frequency_penalty
            or (opts.repetition_penalty is not None and opts.repetition_penalty != 1.0)
        )

    @property
    def terminated(self) -> bool:
        """The grammar is complete and allows nothing more."""
        return self._matcher is not None and self._matcher.terminated

    def choose(self, h: int, seed_word: int, natural: int, held_back: frozenset[int]) -> int:
        """The token after a sequence of hash ``h``: ``natural`` is the unsteered choice,
        ``held_back`` the stop tokens ``min_tokens`` does not allow yet. ``-1``: no candidate."""
        cands = self._candidates(held_back)
        if not len(cands):
            return -1
        z = np.array([mix64(h ^ seed_word)], dtype=np.uint64)
        words = cands.astype(np.uint64)
        words += np.uint64(_SCORE_SALT)
        mix_in_place(words)
        words ^= z
        mix_in_place(words)
        scores = (words >> np.uint64(11)).astype(np.float64) * (_SPREAD / float(1 << 53))
        scores[cands == natural] = _NATURAL
        if self._matcher is not None and self._produced:
            scores[np.isin(cands, self._closers)] += _CLOSING_GAIN * self._produced
        if self._repetition != 1.0:
            scores = np.where(self._seen[cands], scores / self._repetition, scores)
        if self._presence or self._frequency:
            counts = self._counts[cands].astype(np.float64)
            scores -= counts * self._frequency + (counts > 0) * self._presence
        if len(self._bias_ids):
            where = np.searchsorted(self._bias_ids, cands)
            where[where >= len(self._bias_ids)] = 0
            hit = self._bias_ids[where] == cands
            scores[hit] += self._bias_vals[where[hit]]
        return int(cands[int(np.argmax(scores))])

    def _candidates(self, held_back: frozenset[int]) -> npt.NDArray[np.int64]:
        if self._matcher is not None:
            allowed = self._matcher.allowed().copy()
            if self._matcher.accepting and len(self._stop_ids):
                allowed[self._stop_ids] = True  # the request's own stop tokens end it too
        else:
            allowed = np.ones(self._size, dtype=np.bool_)
        if held_back:
            allowed[[t for t in held_back if 0 <= t < self._size]] = False
        if len(self._bias_ids):
            allowed[self._bias_ids[self._bias_vals <= _BAN]] = False
        return np.flatnonzero(allowed).astype(np.int64)

    def accept(self, token: int, stops: bool) -> None:
        """``token`` was chosen (``stops``: it ends the request as a stop token)."""
        self._produced += 1
        if 0 <= token < self._size:
            self._counts[token] += 1
            self._seen[token] = True
        if self._matcher is not None and not stops:
            self._matcher.accept(token)
