"""Deterministic tokens: the token at each position is a function of (seed, every token before).

A sequence carries a rolling polynomial hash of its tokens modulo 2**64,
``H(t_1..t_n) = B*P**n + sum((t_i + K) * P**(n - i))``, so appending a token costs one multiply and
one add (``H' = H*P + t + K``), and a prompt is hashed once, vectorised, with cached powers of P.
The next token is a mix (splitmix64's finaliser) of ``H`` with a per-request seed word, reduced to
the vocabulary; its top bits decide whether the model emits EOS instead (``eos_rate``).

Greedy requests (temperature 0) use a fixed seed word, like a real model whose argmax ignores the
seed; sampled requests mix in their seed (or the engine's default seed). Re-running prompt + the
first k generated tokens therefore continues with exactly the remaining tokens: migration relies
on it.

All arithmetic on uint64 *arrays* (never numpy scalars, which warn on overflow) so that a decode
step for the whole batch is a handful of numpy operations.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from protocols.engine import TokenLogprob
from protocols.pages import token_bytes

__all__ = ["TokenModel", "U64Array", "mix64", "mix_in_place"]

U64Array = npt.NDArray[np.uint64]

_MASK = (1 << 64) - 1
_P = 0x100000001B3  # FNV-1a 64-bit prime: odd, so powers never collapse to 0
_P_INV = pow(_P, -1, 1 << 64)  # odd: invertible modulo 2**64
_K = 0x9E3779B97F4A7C15  # offset added to every token, so leading zeros still count
_BASIS = 0xCBF29CE484222325
_GREEDY_WORD = 0x6A09E667F3BCC908  # seed word of temperature-0 requests
_SEED_SALT = 0xBB67AE8584CAA73B
_EOS_BITS = 24
_LOGPROB_SALT = 0x3C6EF372FE94F82B

_P_U = np.uint64(_P)
_K_U = np.uint64(_K)
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_S40 = np.uint64(64 - _EOS_BITS)


def mix_in_place(z: U64Array) -> U64Array:
    """splitmix64's finaliser on every word of ``z``, in place (returns ``z``)."""
    z ^= z >> _S30
    z *= _C1
    z ^= z >> _S27
    z *= _C2
    z ^= z >> _S31
    return z


def mix64(x: int) -> int:
    """splitmix64's finaliser on one Python int (the scalar twin of the vectorised mix)."""
    x &= _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class TokenModel:
    """The simulated model's token function over a vocabulary of ``vocab_size`` ids."""

    def __init__(self, vocab_size: int, eos_token_id: int, eos_rate: float) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._regular = np.uint64(vocab_size - 1)  # regular tokens: every id but EOS
        self._eos = np.uint64(eos_token_id)
        self._eos_threshold = np.uint64(round(eos_rate * (1 << _EOS_BITS)))
        self.emits_eos = eos_rate > 0.0
        self._pows: U64Array = np.ones(1, dtype=np.uint64)
        self._pow_sums: U64Array = np.array([0, 1], dtype=np.uint64)  # [k]: sum of P**0..P**(k-1)

    # -- seeds ------------------------------------------------------------------------------

    @staticmethod
    def seed_word(seed: int, greedy: bool) -> int:
        """The per-request word mixed into every token."""
        return _GREEDY_WORD if greedy else mix64(seed ^ _SEED_SALT)

    # -- prefix hashes ----------------------------------------------------------------------

    def _powers(self, n: int) -> U64Array:
        if len(self._pows) <= n:
            size = max(n + 1, 2 * len(self._pows))
            # P**k mod 2**64 and their running sums: uint64 products and sums wrap modulo
            # 2**64, so both are exact (a Python-int loop took milliseconds on an engine's
            # event loop when a live migration's context was longer than any before).
            pows = np.full(size, _P_U, dtype=np.uint64)
            pows[0] = 1
            self._pows = np.cumprod(pows, out=pows)
            sums = np.zeros(size + 1, dtype=np.uint64)
            np.cumsum(pows, out=sums[1:])
            self._pow_sums = sums
        return self._pows

    def prefix_hash(self, tokens: Sequence[int] | npt.NDArray[np.int64]) -> int:
        """``H`` of a whole sequence, in O(n) numpy work (no conversion for an int64 array)."""
        n = len(tokens)
        pows = self._powers(n)
        head = (_BASIS * int(pows[n])) & _MASK
        if n == 0:
            return head
        if isinstance(tokens, np.ndarray):
            arr = np.asarray(tokens, dtype=np.int64).view(np.uint64)  # the same bits mod 2**64
        else:
            arr = np.frombuffer(token_bytes(tokens), dtype=np.uint64)
        # sum((t_i + K) * P**(n-i)) as one dot product (wrapping mod 2**64, no temporaries)
        # plus K times the cached sum of those powers: a live migration's receiver hashes 4k+.
        dot = int(np.dot(arr, pows[n - 1 :: -1]))
        return (head + dot + _K * int(self._pow_sums[n])) & _MASK

    @staticmethod
    def extend(h: int, token: int) -> int:
        """``H`` after appending ``token`` (scalar)."""
        return (h * _P + token + _K) & _MASK

    @staticmethod
    def retract(h: int, token: int) -> int:
        """``H`` before appending ``token`` to a sequence of hash ``h`` (undoes :meth:`extend`)."""
        return ((h - token - _K) * _P_INV) & _MASK

    @staticmethod
    def extend_many(h: U64Array, tokens: npt.NDArray[np.int64]) -> U64Array:
        """``H`` after appending one token to each sequence (vectorised)."""
        out = h * _P_U
        out += tokens.astype(np.uint64)
        out += _K_U
        return out

    @staticmethod
    def extend_in_place(h: U64Array, tokens: npt.NDArray[np.int64]) -> None:
        """Append one token to each sequence, updating ``h`` in place."""
        h *= _P_U
        h += tokens.astype(np.uint64)
        h += _K_U

    # -- next tokens ------------------------------------------------------------------------

    def next_tokens(
        self, h: U64Array, seed_words: U64Array
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_] | None]:
        """For each sequence: the regular (non-EOS) next token and whether EOS comes instead.

        The EOS mask is ``None`` when the model never emits EOS (``eos_rate == 0``).
        """
        z = mix_in_place(h ^ seed_words)
        regular = z % self._regular
        regular += regular >= self._eos  # skip the EOS id: regular tokens never stop a request
        eos = (z >> _S40) < self._eos_threshold if self.emits_eos else None
        return regular.astype(np.int64), eos

    def next_token(self, h: int, seed_word: int) -> tuple[int, bool]:
        """The scalar form of :meth:`next_tokens` for one sequence, in Python ints (a dozen
        numpy calls on one-element arrays cost more: a live migration's receiver makes one)."""
        z = mix64(h ^ seed_word)
        regular = z % (self.vocab_size - 1)
        regular += regular >= self.eos_token_id
        eos = self.emits_eos and (z >> (64 - _EOS_BITS)) < int(self._eos_threshold)
        return regular, eos

    def logprobs(self, tokens: Sequence[int], start: int, top: int) -> list[TokenLogprob]:
        """Log probabilities for ``tokens``, at positions ``start`` on of their sequence, with
        ``top`` most likely tokens each: every token the most likely where it stands (as the
        greedy choice is), its logprob a function of (position, token) only, so any worker that
        generates the token there (after a migration too) reports the same. The alternatives
        are the next ids, each far less likely, so the probabilities never sum above 1."""
        out: list[TokenLogprob] = []
        for position, token in enumerate(tokens, start):
            z = mix64(position * _P ^ token ^ _LOGPROB_SALT)
            first = -0.3 - 0.4 * (z & 0xFFFF) / 0x10000  # a probability in [0.5, 0.74]
            ids = [(token + j) % self.vocab_size for j in range(top)]
            out.append(
                TokenLogprob(first, ids, [first - 1.0 - j if j else first for j in range(top)])
            )
        return out

    def alternative(self, token: int, banned: frozenset[int]) -> int:
        """A deterministic replacement for a token the request may not produce (min_tokens)."""
        candidate = token
        for _ in range(self.vocab_size):
            candidate = (candidate + 1) % self.vocab_size
            if candidate != self.eos_token_id and candidate not in banned:
                return candidate
        raise ValueError("every token of the vocabulary is banned")
