"""Tokenizers: the built-in byte-level one and a Hugging Face one loaded from a local folder."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.serving.frontend import ByteTokenizer, Detokenizer, HFTokenizer, Tokenizer
from protocols.errors import InvalidRequest
from tests.frontend._hf import build_tokenizer_folder

TEXT = "Héllo wörld 🎉 日本語, plain ASCII too."


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    folder = build_tokenizer_folder(tmp_path_factory.mktemp("tok"))
    return HFTokenizer.from_pretrained(folder)


def _stream(detok: Detokenizer, ids: list[int], sizes: list[int]) -> list[str]:
    out, i, k = [], 0, 0
    while i < len(ids):
        n = max(1, sizes[k % len(sizes)]) if sizes else 1
        out.append(detok.step(ids[i : i + n]))
        i, k = i + n, k + 1
    out.append(detok.flush())
    return out


def test_byte_tokenizer_roundtrip_and_specials() -> None:
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids[0] == ByteTokenizer.BOS
    assert ids[1:] == list(TEXT.encode())
    assert tok.encode("ab", add_special_tokens=False) == [97, 98]
    assert tok.decode([*ids, ByteTokenizer.EOS]) == TEXT
    assert tok.eos_token_ids == [ByteTokenizer.EOS]


def test_byte_tokenizer_chat_template() -> None:
    tok = ByteTokenizer()
    ids = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert ids[0] == ByteTokenizer.BOS
    assert tok.decode(ids) == "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"


def test_byte_tokenizer_rejects_lone_surrogates() -> None:
    with pytest.raises(InvalidRequest):
        ByteTokenizer().encode("bad \ud800 text")


def test_byte_detokenizer_never_splits_a_character() -> None:
    tok = ByteTokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    pieces = _stream(tok.detokenizer([]), ids, [1])
    assert "".join(pieces) == TEXT
    # Every piece is whole characters: no replacement character appears mid-stream.
    assert all("\ufffd" not in p for p in pieces)


@given(st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=60))
def test_byte_tokenizer_decodes_any_ids(ids: list[int]) -> None:
    tok = ByteTokenizer()
    text = tok.decode(ids)
    assert text == tok.decode(ids)  # deterministic
    text.encode("utf-8")  # valid Unicode (no lone surrogate), whatever the ids
    words = [i for i in ids if not 0 <= i <= ByteTokenizer.EOS]
    assert tok.decode(words).isprintable()


@given(
    st.lists(st.integers(min_value=0, max_value=600), max_size=60),
    st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=8),
)
def test_byte_detokenizer_streaming_matches_decode(ids: list[int], sizes: list[int]) -> None:
    tok = ByteTokenizer()
    assert "".join(_stream(tok.detokenizer([]), ids, sizes)) == tok.decode(ids)


@given(st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=60))
def test_byte_detokenizer_one_id_per_step_matches_decode(ids: list[int]) -> None:
    # One id per step is the decode loop's usual output (a fast path for a lone word id).
    tok = ByteTokenizer()
    assert "".join(_stream(tok.detokenizer([]), ids, [1])) == tok.decode(ids)


def test_word_ids_are_printable_and_deterministic() -> None:
    tok = ByteTokenizer()
    words = [tok.decode([i]) for i in range(258, 600)]
    assert all(w.strip() and w.strip().isalpha() and w.isprintable() for w in words)
    assert words == [tok.decode([i]) for i in range(258, 600)]


def test_hf_tokenizer_loads_from_folder(hf: HFTokenizer) -> None:
    assert isinstance(hf, Tokenizer)
    ids = hf.encode(TEXT)
    assert hf.decode(ids) == TEXT
    assert hf.eos_token_ids == [hf.encode("<|im_end|>", add_special_tokens=False)[0]]


def test_hf_tokenizer_accepts_a_path_or_a_loaded_tokenizer(hf: HFTokenizer, tmp_path: Path) -> None:
    folder = build_tokenizer_folder(tmp_path)
    by_path = HFTokenizer(folder)
    by_str = HFTokenizer(str(folder), eos_token_ids=[0])
    assert by_path.encode(TEXT) == by_str.encode(TEXT) == hf.encode(TEXT)
    assert by_str.eos_token_ids == [0]


def test_hf_tokenizer_uses_its_chat_template(hf: HFTokenizer) -> None:
    ids = hf.apply_chat_template([{"role": "user", "content": "hello world"}])
    im_start = hf.encode("<|im_start|>", add_special_tokens=False)
    assert ids[: len(im_start)] == im_start
    # Special tokens are skipped when decoding, the rest of the template stays.
    assert hf.decode(ids) == "user\nhello world\nassistant\n"


def test_hf_template_errors_are_invalid_requests(hf: HFTokenizer) -> None:
    with pytest.raises(InvalidRequest, match="chat template"):
        hf.apply_chat_template([{"role": "tool", "content": "x"}])


@given(st.lists(st.integers(min_value=1, max_value=4), min_size=1, max_size=6))
def test_hf_streaming_matches_decode(hf: HFTokenizer, sizes: list[int]) -> None:
    prompt = hf.apply_chat_template([{"role": "user", "content": "hi"}])
    ids = hf.encode(" " + TEXT, add_special_tokens=False)
    pieces = _stream(hf.detokenizer(prompt), ids, sizes)
    # The leading space survives (the decoder sees the prompt's tail as context) and no piece
    # holds half a character.
    assert "".join(pieces) == " " + TEXT
    assert all("\ufffd" not in p for p in pieces)


def test_hf_detokenizer_survives_bad_ids(hf: HFTokenizer) -> None:
    detok = hf.detokenizer([])
    ok = hf.encode("hello", add_special_tokens=False)
    assert detok.step([-1, *ok, 10**12]) == "hello"


def test_token_bytes_spell_the_text_token_by_token(hf: HFTokenizer) -> None:
    from tokenizers import pre_tokenizers

    from actors.serving.frontend._tokenizer import _byte_level_decoder

    assert set(_byte_level_decoder()) == set(pre_tokenizers.ByteLevel.alphabet())
    for tokenizer in (hf, ByteTokenizer()):
        ids = tokenizer.encode(" " + TEXT, add_special_tokens=False)
        # Exact bytes, also of tokens that end mid-character ("🎉" spans several).
        assert b"".join(tokenizer.token_bytes(t) for t in ids) == (" " + TEXT).encode()
    assert hf.token_bytes(hf.eos_token_ids[0]) == b"<|im_end|>"  # a special token: its name
    assert ByteTokenizer().token_bytes(ByteTokenizer.EOS) == b"<eos>"
    assert hf.token_bytes(10**12) == b""


def test_non_fast_tokenizer_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fast tokenizer"):
        HFTokenizer(object())


def test_hf_tokenizer_never_makes_fewer_tokens_than_its_bound(hf: HFTokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog. 日本語 " * 50 + "<|im_start|>" * 5
    assert hf.max_token_chars >= len("<|im_start|>")
    assert len(hf.encode(text)) >= len(text) / hf.max_token_chars
