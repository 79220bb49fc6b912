"""Tokenisation, chat templates and incremental detokenisation.

Two implementations of :class:`Tokenizer`:

- :class:`ByteTokenizer`, built in, for the mock engine: ids 0-255 are UTF-8 bytes, two special
  ids (BOS, EOS), a plain-text chat template. Every other id (the mock's vocabulary is larger)
  decodes deterministically to a printable syllable, so decoding never fails whatever the engine
  sends.
- :class:`HFTokenizer`: a Hugging Face tokenizer loaded from a local folder (or a ``.gguf`` file),
  its own chat template, and ``tokenizers``' ``DecodeStream`` for streaming detokenisation.

A :class:`Detokenizer` is per request: it turns batches of new token ids into new text and never
emits half a UTF-8 sequence (it holds the bytes back until the character is complete).
"""

from __future__ import annotations

import codecs
import functools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from protocols import byte_vocab
from protocols.errors import InvalidRequest

__all__ = ["ByteTokenizer", "Detokenizer", "HFTokenizer", "Tokenizer"]


@runtime_checkable
class Detokenizer(Protocol):
    """Incremental detokeniser for one generation stream."""

    def step(self, token_ids: Sequence[int]) -> str:
        """Feed the new ids of one output; return the text they complete ('' if none yet)."""
        ...

    def flush(self) -> str:
        """The stream ended: return what is still held back (as U+FFFD for broken bytes)."""
        ...


@runtime_checkable
class Tokenizer(Protocol):
    """What the frontend needs from a model's tokenizer.

    ``encode`` and ``apply_chat_template`` raise :class:`~protocols.errors.InvalidRequest` for input
    they cannot tokenise (a template that rejects the conversation, text that is not Unicode).
    """

    @property
    def eos_token_ids(self) -> list[int]:
        """Ids that end a generation (sent to the engine as ``eos_token_ids``)."""
        ...

    @property
    def max_token_chars(self) -> int:
        """The most characters one token of an encoded text can stand for: a text of ``n``
        characters encodes to at least ``n / max_token_chars`` tokens, which refuses a prompt
        too long for the context before any tokenisation work."""
        ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with BOS and friends when ``add_special_tokens``)."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``, special tokens skipped; never fails on unknown ids."""
        ...

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template writes ``tools`` and assistants' ``tool_calls`` itself;
        else the frontend writes them into the messages (see ``_parsers._prompt``)."""
        ...

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of the conversation, ending with the assistant's generation prompt;
        ``tools`` (OpenAI's JSON form) go to a template that :attr:`renders_tools`."""
        ...

    def detokenizer(self, prompt_ids: Sequence[int]) -> Detokenizer:
        """A fresh incremental detokeniser for a generation that continues ``prompt_ids``."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for on its own (a special token's name), for logprobs."""
        ...


# --- the built-in byte-level tokenizer ---------------------------------------------------------


class ByteTokenizer:
    """Byte-level tokenizer for the mock engine.

    Ids 0-255 are the bytes of the UTF-8 text; ``BOS`` (256) and ``EOS`` (257) are special (never
    decoded to text); any other id, negative ones included, decodes to a printable syllable chosen
    by the id, with a space before every third one, so mock output reads like words.
    """

    BOS = byte_vocab.BOS
    EOS = byte_vocab.EOS
    #: Ids below this are bytes or special; ids from here on are syllables.
    FIRST_WORD_ID = byte_vocab.FIRST_WORD_ID

    @property
    def eos_token_ids(self) -> list[int]:
        return [self.EOS]

    @property
    def max_token_chars(self) -> int:
        return 1  # one token per UTF-8 byte: never fewer tokens than characters

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequest("the text is not valid Unicode (lone surrogate)") from exc
        ids = list(data)
        return [self.BOS, *ids] if add_special_tokens else ids

    def decode(self, token_ids: Sequence[int]) -> str:
        detok = _ByteDetokenizer()
        return detok.step(token_ids) + detok.flush()

    @property
    def renders_tools(self) -> bool:
        return False  # its plain-text template gets tools and calls written into the messages

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        # A ChatML-like plain-text template: roles and separators are ordinary bytes, so the
        # mock engine needs no extra special ids.
        parts = [
            f"<|{m.get('role', 'user')}|>\n{m.get('content') or ''}<|end|>\n" for m in messages
        ]
        parts.append("<|assistant|>\n")
        return self.encode("".join(parts))

    def detokenizer(self, prompt_ids: Sequence[int]) -> Detokenizer:
        # Bytes carry no context across the prompt boundary, so the prompt is not needed.
        return _ByteDetokenizer()

    def token_bytes(self, token_id: int) -> bytes:
        return byte_vocab.token_text(token_id)


_word = byte_vocab.word


class _ByteDetokenizer:
    __slots__ = ("_decoder", "_partial")

    def __init__(self) -> None:
        # errors="replace": invalid byte sequences become U+FFFD instead of failing; incomplete
        # ones are held until the next bytes arrive.
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._partial = False  # the decoder may hold the start of a character

    def step(self, token_ids: Sequence[int]) -> str:
        if token_ids and not 0 <= token_ids[0] < 256:
            if len(token_ids) == 1 and not self._partial:
                # One word id, the usual output of the mock's decode step: what _mixed gives.
                tid = token_ids[0]
                return "" if tid in (ByteTokenizer.BOS, ByteTokenizer.EOS) else _word(tid)
            return self._mixed(token_ids)  # (bytes() would only fail on it)
        try:
            # Fast path: only byte ids (bytes() rejects anything outside 0-255).
            data = bytes(token_ids)
        except (ValueError, TypeError):
            return self._mixed(token_ids)
        self._partial = True
        return self._decoder.decode(data)

    def _mixed(self, token_ids: Sequence[int]) -> str:
        out: list[str] = []
        pending = bytearray()
        for tid in token_ids:
            if 0 <= tid < 256:
                pending.append(tid)
                continue
            if tid in (ByteTokenizer.BOS, ByteTokenizer.EOS):
                continue
            if pending or self._partial:
                # A word id ends any byte sequence in progress: decode what is complete and
                # show a dangling partial character as U+FFFD, like any other broken sequence.
                out.append(self._decoder.decode(bytes(pending), final=True))
                pending.clear()
                self._decoder.reset()
                self._partial = False
            out.append(_word(tid))
        if pending:
            self._partial = True
            out.append(self._decoder.decode(bytes(pending)))
        return "".join(out)

    def flush(self) -> str:
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        self._partial = False
        return text


# --- Hugging Face tokenizers -------------------------------------------------------------------

#: How many prompt ids seed a stream decoder, so the first generated token is decoded in context
#: (SentencePiece-style decoders drop a leading space at the start of a sequence).
_PROMPT_CONTEXT_IDS = 6
_MAX_TOKEN_ID = 2**32 - 1


class HFTokenizer:
    """A Hugging Face *fast* tokenizer with its own chat template.

    ``source`` is a local folder (``tokenizer.json`` and friends), a ``.gguf`` file, or an already
    loaded ``transformers`` tokenizer; nothing is downloaded. ``eos_token_ids`` overrides the
    tokenizer's own EOS.
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | Any,
        *,
        eos_token_ids: Sequence[int] | None = None,
    ) -> None:
        tokenizer = _load(source) if isinstance(source, (str, os.PathLike)) else source
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(
                f"{type(tokenizer).__name__} is not a fast tokenizer; streaming detokenisation "
                "needs one (tokenizer.json)"
            )
        self._tok = tokenizer
        # Some tokenizer.json files truncate (all-MiniLM-L6-v2's at 128 tokens) or pad: a prompt
        # is never cut silently; one too long for the model is refused by its length.
        backend.no_truncation()
        backend.no_padding()
        self._backend = backend
        if eos_token_ids is None:
            eos = tokenizer.eos_token_id
            eos_token_ids = [] if eos is None else [int(eos)]
        self._eos = list(eos_token_ids)
        self._max_token_chars: int | None = None
        self._renders_tools: bool | None = None

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike[str], *, eos_token_ids: Sequence[int] | None = None
    ) -> HFTokenizer:
        """Load the tokenizer stored at ``path`` (a folder, or a ``.gguf`` file), offline."""
        return cls(_load(path), eos_token_ids=eos_token_ids)

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos)

    @property
    def max_token_chars(self) -> int:
        if self._max_token_chars is None:
            # A vocabulary entry's length counts the bytes it stands for (byte-level BPE) or
            # its characters plus a word marker (SentencePiece): never fewer than it covers.
            vocab = self._tok.get_vocab()
            self._max_token_chars = max((len(token) for token in vocab), default=1)
        return self._max_token_chars

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        try:
            ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        except UnicodeError as exc:
            raise InvalidRequest("the text is not valid Unicode (lone surrogate)") from exc
        return list(ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        detok = self.detokenizer(())
        return detok.step(token_ids) + detok.flush()

    @property
    def renders_tools(self) -> bool:
        if self._renders_tools is None:
            # A template that never mentions tools would drop them silently (SmolLM2's does).
            template = getattr(self._tok, "chat_template", None)
            sources = template.values() if isinstance(template, dict) else [template or ""]
            self._renders_tools = any("tools" in str(t) for t in sources)
        return self._renders_tools

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        import jinja2

        extra: dict[str, Any] = {"tools": list(tools)} if tools else {}
        try:
            text = self._tok.apply_chat_template(
                list(messages), add_generation_prompt=True, tokenize=False, **extra
            )
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as exc:
            # Templates reject conversations they cannot render (roles out of order, ...):
            # that is the client's input, so a 400, not a 500.
            raise InvalidRequest(f"the chat template rejected the messages: {exc}") from exc
        # The rendered template already holds BOS and the role markers.
        return self.encode(str(text), add_special_tokens=False)

    def detokenizer(self, prompt_ids: Sequence[int]) -> Detokenizer:
        return _StreamDetokenizer(self._backend, prompt_ids[-_PROMPT_CONTEXT_IDS:])

    def token_bytes(self, token_id: int) -> bytes:
        token = self._backend.id_to_token(token_id) if 0 <= token_id <= _MAX_TOKEN_ID else None
        if token is None:
            return b""
        if type(self._backend.decoder).__name__ == "ByteLevel":
            # A byte-level vocabulary spells each byte as one printable character: mapped
            # back, a token that ends mid-character still gives its exact bytes.
            table = _byte_level_decoder()
            if all(ch in table for ch in token):
                return bytes(table[ch] for ch in token)
        text: str = self._backend.decode([token_id], skip_special_tokens=False)
        return text.encode()


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, from character back to byte."""
    # The alphabet is GPT-2's ``bytes_to_unicode`` image: printable bytes stand for themselves,
    # the others for 256 + their rank among them.
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


def _load(path: str | os.PathLike[str]) -> Any:
    from transformers import AutoTokenizer

    p = Path(path)
    if p.suffix == ".gguf":
        # Reading a GGUF's tokenizer parses the whole file (tens of seconds for a small model):
        # save_pretrained() it to a folder once when startup time matters.
        return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name, local_files_only=True)
    return AutoTokenizer.from_pretrained(p, local_files_only=True)


class _StreamDetokenizer:
    __slots__ = ("_backend", "_stream")

    def __init__(self, backend: Any, context_ids: Sequence[int]) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = backend
        self._stream = DecodeStream(ids=list(context_ids) or None, skip_special_tokens=True)

    def step(self, token_ids: Sequence[int]) -> str:
        if not token_ids:
            return ""
        try:
            text = self._stream.step(self._backend, list(token_ids))
        except TypeError:
            # An id the Rust side cannot hold (negative, too large): an engine bug, but
            # decoding must not fail the request; such ids are dropped.
            valid = [t for t in token_ids if 0 <= t <= _MAX_TOKEN_ID]
            text = self._stream.step(self._backend, valid) if valid else None
        return text or ""

    def flush(self) -> str:
        # DecodeStream holds ids only while they form an incomplete character; a stream that
        # ends there has nothing printable left.
        return ""
