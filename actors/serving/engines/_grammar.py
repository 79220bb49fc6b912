"""Structured output for the engines: a :class:`~protocols.engine.Grammar` compiled for a
vocabulary, and a per-request matcher that gives the allowed tokens of each step.

The grammar engine is llguidance because it compiles a schema at admission far faster than
xgrammar, its per-token masks cost next to nothing beside a model step, and it needs no torch,
so the mock engine uses it too (the figures: ``benchmarks/RESULTS.md``, grammar_engines).

A :class:`Vocabulary` is what the grammar engine knows of a tokenizer (token id -> bytes, its
EOS ids); :meth:`Vocabulary.matcher` compiles a grammar (cached by ``(kind, spec)``), raising
:class:`~protocols.errors.InvalidRequest` for an invalid one, and replays the tokens earlier
attempts of a migrated request generated, so a continuation is constrained exactly as the
first attempt was. A :class:`GrammarMatcher` is used by one thread at a time.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import llguidance
import numpy as np
import numpy.typing as npt

from protocols.engine import Grammar, PreprocessedRequest
from protocols.errors import InvalidRequest

__all__ = ["GrammarMatcher", "Vocabulary", "generated_tail"]

_CACHE_SIZE = 256  # compiled grammars kept per vocabulary (a service reuses a few schemas)


def generated_tail(request: PreprocessedRequest) -> list[int]:
    """The tokens at the end of ``request.token_ids`` that earlier attempts generated: output
    for the penalties, and what its grammar replays."""
    return list(request.token_ids[-request.generated :]) if request.generated > 0 else []


class GrammarMatcher:
    """One request's position in its grammar: the mask of the next step, accepting tokens."""

    __slots__ = ("_bits", "_matcher", "_size")

    def __init__(self, matcher: llguidance.LLMatcher, size: int) -> None:
        self._matcher = matcher
        self._size = size
        self._bits = np.zeros((size + 31) // 32, dtype=np.int32)

    def allowed(self) -> npt.NDArray[np.bool_]:
        """Which token ids may come next (shape ``(vocab size,)``); the tokenizer's EOS is among
        them once the output so far is complete (:attr:`accepting`)."""
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self._size]
        return bits.view(np.bool_)

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False if the grammar does not allow it (the matcher is then
        broken: nothing more is allowed)."""
        return bool(self._matcher.consume_token(token))

    @property
    def accepting(self) -> bool:
        """The output so far is a complete sentence of the grammar (it may stop here)."""
        return bool(self._matcher.is_accepting())

    @property
    def terminated(self) -> bool:
        """Nothing but EOS may follow: the request ends here (``finish_reason`` ``stop``)."""
        return bool(self._matcher.is_stopped())


class Vocabulary:
    """A tokenizer as the grammar engine sees it, and the grammars compiled for it."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, size: int) -> None:
        self._tokenizer = tokenizer
        self.size = size
        self._lock = threading.Lock()  # the hf engine compiles on the loop, matches elsewhere
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()

    @classmethod
    def from_token_bytes(
        cls,
        tokens: Sequence[bytes],
        *,
        eos_token_id: int,
        special_ids: Collection[int] = (),
        encode: Callable[[bytes], list[int]] | None = None,
    ) -> Vocabulary:
        """A vocabulary given as each id's bytes (a special token's: its name). ``encode``
        turns text into ids (any valid tokenisation will do); default: one id per byte."""
        wrapper = llguidance.TokenizerWrapper(
            _Tokens(tokens, eos_token_id, sorted({eos_token_id, *special_ids}), encode)
        )
        return cls(llguidance.LLTokenizer(wrapper, n_vocab=len(tokens)), len(tokens))

    @classmethod
    def from_tokenizer_file(
        cls, path: Path, *, size: int, eos_token_ids: Sequence[int]
    ) -> Vocabulary:
        """A Hugging Face ``tokenizer.json`` over a model vocabulary of ``size`` ids (the model's
        may be padded past the tokenizer's)."""
        eos = list(eos_token_ids)
        tokenizer = llguidance.LLTokenizer(
            path.read_text(), n_vocab=size, eos_token=eos if len(eos) > 1 else eos[0]
        )
        return cls(tokenizer, size)

    def matcher(self, grammar: Grammar, replay: Sequence[int] = ()) -> GrammarMatcher:
        """A fresh matcher for ``grammar``, advanced over ``replay`` (tokens a migrated request
        generated before). :class:`InvalidRequest` for an invalid grammar or a replay it does
        not allow."""
        key = (grammar.kind, grammar.spec)
        with self._lock:
            proto = self._cache.get(key)
            if proto is not None:
                self._cache.move_to_end(key)
        if proto is None:
            proto = self._compile(grammar)
            with self._lock:
                self._cache[key] = proto
                if len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
        matcher = GrammarMatcher(proto.deep_copy(), self.size)
        for token in replay:
            if not matcher.accept(token):
                raise InvalidRequest(
                    f"the generated tokens do not follow the {grammar.kind} grammar"
                )
        return matcher

    def _compile(self, grammar: Grammar) -> llguidance.LLMatcher:
        try:
            source = _llguidance_grammar(grammar)
        except (ValueError, TypeError, KeyError, AssertionError) as exc:
            raise InvalidRequest(f"invalid {grammar.kind} grammar: {exc}") from exc
        matcher = llguidance.LLMatcher(self._tokenizer, source, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"invalid {grammar.kind} grammar: {matcher.get_error()}")
        return matcher


def _llguidance_grammar(grammar: Grammar) -> str:
    kind, spec = grammar.kind, grammar.spec
    if kind == "json_schema":
        json.loads(spec)  # a clear message for text that is not JSON at all
        return str(llguidance.LLMatcher.grammar_from_json_schema(spec))
    if kind == "json_object":
        return str(llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}'))
    if kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(spec))
    if kind == "ebnf":
        return str(llguidance.grammar_from("ebnf", spec))
    if kind == "structural_tag":
        return _structural_tag(spec)
    raise ValueError(f"unknown grammar kind {kind!r}")


def _structural_tag(spec: str) -> str:
    """SGLang's structural tag (``structures`` with ``begin``, ``schema``, ``end``, and the
    ``triggers`` that start them) as llguidance's lazy structural tags."""
    tag = json.loads(spec)
    if not isinstance(tag, dict) or "structures" not in tag:
        raise ValueError("expected an object with 'structures' and 'triggers'")
    triggers = [str(t) for t in tag.get("triggers") or ()]
    tags: list[Any] = []
    for structure in tag["structures"]:
        begin = str(structure["begin"])
        trigger = next((t for t in triggers if t and begin.startswith(t)), None)
        if trigger is None:
            raise ValueError(f"no trigger starts the structure beginning {begin!r}")
        schema = structure.get("schema", {})
        tags.append(
            llguidance.StructTag(
                trigger=trigger, begin=begin, grammar=schema, end=str(structure.get("end", ""))
            )
        )
    if not tags:
        raise ValueError("no structures")
    return str(llguidance.StructTag.to_grammar(tags, assume_special=False))


class _Tokens:
    """What ``llguidance.TokenizerWrapper`` reads of a tokenizer."""

    def __init__(
        self,
        tokens: Sequence[bytes],
        eos_token_id: int,
        special_ids: list[int],
        encode: Callable[[bytes], list[int]] | None,
    ) -> None:
        self.tokens = tokens
        self.eos_token_id = eos_token_id
        self.bos_token_id: int | None = None
        self.special_token_ids = special_ids
        self._encode = encode or list

    def __call__(self, text: bytes) -> list[int]:
        return self._encode(text)
