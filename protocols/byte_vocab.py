"""The mock engine's vocabulary: what each token id stands for, as bytes.

Ids 0-255 are those bytes; ``BOS`` (256) and ``EOS`` (257) are special; every other id stands
for a printable syllable chosen by the id, with a space before every third one, so mock output
reads like words. The frontend's ``ByteTokenizer`` decodes by it and the mock engine constrains
its output (structured output) by it: this module is their one source of truth.
"""

from __future__ import annotations

import functools

__all__ = ["BOS", "EOS", "FIRST_WORD_ID", "token_text", "word"]

BOS = 256
EOS = 257
#: Ids below this are bytes or special; ids from here on are syllables.
FIRST_WORD_ID = 258

_CONSONANTS = "bdfghjklmnprstvz"
_VOWELS = "aeiou"
_SYLLABLES = tuple(c + v for c in _CONSONANTS for v in _VOWELS)


@functools.lru_cache(maxsize=1 << 16)  # the mock's vocabulary fits: one lookup per token
def word(token_id: int) -> str:
    """The syllable a word id (any id from ``FIRST_WORD_ID`` on, or negative) stands for."""
    n = token_id - FIRST_WORD_ID
    syllable = _SYLLABLES[n % len(_SYLLABLES)]
    return " " + syllable if (n // len(_SYLLABLES)) % 3 == 0 else syllable


def token_text(token_id: int) -> bytes:
    """The bytes one token stands for on its own (a special token's name)."""
    if 0 <= token_id < 256:
        return bytes((token_id,))
    if token_id == BOS:
        return b"<bos>"
    if token_id == EOS:
        return b"<eos>"
    return word(token_id).encode()
