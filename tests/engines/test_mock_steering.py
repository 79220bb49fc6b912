"""The mock engine's structured output, logit_bias, penalties and prompt logprobs, and that a
migrated request (``generated`` tokens replayed) continues with exactly the uninterrupted run's
tokens with all of them."""

from __future__ import annotations

import json
import re
from typing import Any

import anyio
import jsonschema_rs
import msgspec
import pytest

from actors.serving.engines import MockEngine
from actors.serving.requests._continuation import continuation
from protocols import byte_vocab
from protocols.engine import BootstrapInfo, Grammar, PreprocessedRequest, SamplingOptions
from protocols.errors import InvalidRequest
from tests.engines._mock_helpers import collect, config, request, run

EOS = byte_vocab.EOS
PROMPT = list(b"Describe a person as JSON:")
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "role": {"enum": ["admin", "user", "guest"]},
        "manager": {"type": ["string", "null"]},
    },
    "required": ["name", "age", "tags", "role"],
    "additionalProperties": False,
}


def _engine(**overrides: Any) -> MockEngine:
    # The frontend's byte tokenizer's EOS: outputs decode with protocols.byte_vocab.
    return MockEngine(config(eos_token_id=EOS, **overrides))


def _text(tokens: list[int]) -> bytes:
    return b"".join(byte_vocab.token_text(t) for t in tokens if t != EOS)


def _steered(
    rid: str,
    *,
    grammar: Grammar | None = None,
    max_tokens: int = 400,
    prompt: list[int] = PROMPT,
    **options: Any,
) -> PreprocessedRequest:
    req = request(rid, prompt, max_tokens=max_tokens, eos_token_ids=[EOS])
    opts = SamplingOptions(guided_decoding=grammar, **options)
    return msgspec.structs.replace(req, sampling_options=opts)


async def test_json_schema_output_always_parses() -> None:
    validator = jsonschema_rs.validator_for(SCHEMA)
    grammar = Grammar(kind="json_schema", spec=json.dumps(SCHEMA))
    results: dict[int, tuple[list[int], str | None]] = {}
    async with _engine(max_running_requests=32) as engine:

        async def one(i: int) -> None:
            req = _steered(f"r{i}", grammar=grammar, temperature=1.0, seed=i)
            tokens, last = await run(engine, req)
            results[i] = tokens, last.finish_reason

        async with anyio.create_task_group() as tg:
            for i in range(100):
                tg.start_soon(one, i)
    texts = set()
    for tokens, reason in results.values():
        assert reason == "stop"
        value = json.loads(_text(tokens))
        validator.validate(value)
        texts.add(_text(tokens))
    assert len(texts) > 90  # the seeds make different documents


@pytest.mark.parametrize(
    ("kind", "spec", "check"),
    [
        ("json_object", "", lambda text: isinstance(json.loads(text), dict)),
        ("regex", r"[0-9]{3}-[a-z]{2,8}", lambda t: re.fullmatch(rb"[0-9]{3}-[a-z]{2,8}", t)),
        ("ebnf", 'root ::= "yes" | "no" | "maybe"', lambda t: t in (b"yes", b"no", b"maybe")),
    ],
)
async def test_grammars_are_honoured(kind: str, spec: str, check: Any) -> None:
    grammar = Grammar(kind=kind, spec=spec)  # type: ignore[arg-type]
    async with _engine() as engine:
        for i in range(10):
            tokens, last = await run(engine, _steered(f"r{i}", grammar=grammar, seed=i))
            assert last.finish_reason == "stop"
            assert check(_text(tokens)), _text(tokens)


async def test_structural_tag_constrains_only_the_tagged_section() -> None:
    tag = {
        "type": "structural_tag",
        "structures": [
            {
                "begin": "<f=x>",
                "schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
                "end": "</f>",
            }
        ],
        "triggers": ["<"],
    }
    grammar = Grammar(kind="structural_tag", spec=json.dumps(tag))
    # logit_bias makes the trigger the first token; the grammar then forces the rest of the
    # section's beginning, an object and its end (the mock's natural text never triggers it).
    bias = {ord("<"): 1.2}
    async with _engine() as engine:
        tokens, _ = await run(
            engine, _steered("r", grammar=grammar, logit_bias=bias, max_tokens=200)
        )
        plain, _ = await run(engine, _steered("p", grammar=grammar, max_tokens=20))
    text = _text(tokens)
    assert text.startswith(b"<f=x>{") and b"</f>" in text
    body = text.removeprefix(b"<f=x>").split(b"</f>")[0]
    assert isinstance(json.loads(body), dict)
    assert b"<" not in _text(plain)  # free text, no section


@pytest.mark.parametrize(
    ("kind", "spec"),
    [
        ("json_schema", '{"type": "objekt"}'),
        ("json_schema", "{not json"),
        ("regex", "[a-"),
        ("ebnf", "root ::= ("),
        ("structural_tag", '{"structures": [{"begin": "<a>", "end": ""}], "triggers": ["<b"]}'),
    ],
)
async def test_an_invalid_grammar_is_refused_at_admission(kind: str, spec: str) -> None:
    grammar = Grammar(kind=kind, spec=spec)  # type: ignore[arg-type]
    async with _engine() as engine:
        with pytest.raises(InvalidRequest, match=f"invalid {kind}"):
            await collect(engine.generate(_steered("bad", grammar=grammar)))
        assert engine.is_quiescent()
        tokens, last = await run(engine, _steered("good", max_tokens=4))
        assert len(tokens) == 4 and last.finish_reason == "length"


async def test_logit_bias_bans_and_forces() -> None:
    async with _engine() as engine:
        plain, _ = await run(engine, _steered("plain", max_tokens=8))
        banned = dict.fromkeys(plain, -100.0)
        other, _ = await run(engine, _steered("ban", max_tokens=8, logit_bias=banned))
        assert not set(other) & set(plain)
        forced, _ = await run(engine, _steered("force", max_tokens=8, logit_bias={1234: 100.0}))
        assert forced == [1234] * 8
        # A bias below the force threshold only shifts: the natural tokens still win.
        shifted, _ = await run(engine, _steered("shift", max_tokens=8, logit_bias={1234: 0.05}))
        assert shifted == plain
        greedy, _ = await run(engine, _steered("greedy", max_tokens=8, temperature=0.0))
        neutral = {99: 0.0}
        zero, _ = await run(
            engine, _steered("zero", max_tokens=8, temperature=0.0, logit_bias=neutral)
        )
        assert zero == greedy != plain


async def test_penalties_change_output_deterministically() -> None:
    bias = {1234: 1.5}  # forces token 1234 until a penalty outweighs it
    async with _engine() as engine:
        forced, _ = await run(engine, _steered("f", max_tokens=8, logit_bias=bias))
        presence, _ = await run(
            engine, _steered("p", max_tokens=8, logit_bias=bias, presence_penalty=1.5)
        )
        frequency, _ = await run(
            engine, _steered("q", max_tokens=8, logit_bias=bias, frequency_penalty=0.4)
        )
        again, _ = await run(
            engine, _steered("q2", max_tokens=8, logit_bias=bias, frequency_penalty=0.4)
        )
    assert forced == [1234] * 8
    assert presence.count(1234) == 1 and presence[0] == 1234
    assert 1 < frequency.count(1234) < 8 and frequency[:2] == [1234, 1234]
    assert frequency == again
    # On a small vocabulary the natural tokens repeat: the penalties thin the repeats out.
    async with _engine(vocab_size=300) as engine:
        plain, _ = await run(engine, _steered("plain", max_tokens=60))
        rep, _ = await run(engine, _steered("rep", max_tokens=60, repetition_penalty=1.5))
        pres, _ = await run(engine, _steered("pres", max_tokens=60, presence_penalty=0.5))
    assert len(set(plain)) < 60
    assert rep != plain and pres != plain
    assert len(set(pres)) > len(set(plain))


async def test_prompt_logprobs_come_once_with_the_first_output() -> None:
    async with _engine() as engine:
        req = msgspec.structs.replace(_steered("r", max_tokens=6), prompt_logprobs=3, logprobs=1)
        outputs = await collect(engine.generate(req))
    first = outputs[0].prompt_logprobs
    assert first is not None and len(first) == len(PROMPT) - 1
    assert all(len(lp.top_ids) == 3 == len(lp.top_logprobs) for lp in first)
    assert all(out.prompt_logprobs is None for out in outputs[1:])
    assert sum(len(out.logprobs or ()) for out in outputs) == 6


async def test_prompt_logprobs_are_the_prefill_workers() -> None:
    boot = BootstrapInfo(host="127.0.0.1", port=7000, room=1)
    req = msgspec.structs.replace(
        _steered("r", max_tokens=4), prompt_logprobs=0, bootstrap_info=boot
    )
    async with _engine(role="prefill") as engine:
        outputs = await collect(engine.generate(req))
        lps = outputs[0].prompt_logprobs
        assert lps is not None and len(lps) == len(PROMPT) - 1
        await engine.abort(req.rid)
    async with _engine(role="decode") as engine:
        stream = engine.generate(req)
        assert stream.rid == req.rid
        await engine.abort(req.rid)
        assert all(out.prompt_logprobs is None for out in await collect(stream))


def _options(case: str) -> dict[str, Any]:
    schema = Grammar(kind="json_schema", spec=json.dumps(SCHEMA))
    return {
        "grammar": {"grammar": schema, "temperature": 1.0, "seed": 7},
        "penalties": {
            "presence_penalty": 0.5,
            "frequency_penalty": 0.3,
            "repetition_penalty": 1.3,
            "logit_bias": {1234: 1.5, 40: -100.0},
        },
        "everything": {
            "grammar": schema,
            "seed": 3,
            "temperature": 0.7,
            "presence_penalty": 0.3,
            "logit_bias": {ord("a"): 0.5},
        },
    }[case]


@pytest.mark.parametrize("case", ["grammar", "penalties", "everything"])
async def test_a_continuation_produces_the_rest_of_the_uninterrupted_run(case: str) -> None:
    original = msgspec.structs.replace(
        _steered("orig", max_tokens=80, **_options(case)), logprobs=2
    )
    async with _engine(vocab_size=4000) as engine:
        outputs = await collect(engine.generate(original))
        full = [t for out in outputs for t in out.token_ids]
        full_lps = [lp for out in outputs for lp in out.logprobs or ()]
        assert len(full) > 6
        for k in (1, 3, len(full) // 2, len(full) - 1):
            cont = continuation(original, full[:k], f"cont{k}")
            assert cont.generated == k
            rest_outputs = await collect(engine.generate(cont))
            rest = [t for out in rest_outputs for t in out.token_ids]
            assert full[:k] + rest == full, k
            assert rest_outputs[-1].finish_reason == outputs[-1].finish_reason
            assert [lp for out in rest_outputs for lp in out.logprobs or ()] == full_lps[k:]
            # Twice over: a continuation of a continuation.
            if k > 2:
                again = continuation(cont, rest[:1], f"again{k}")
                assert again.generated == k + 1
                tail, _ = await run(engine, again)
                assert full[: k + 1] + tail == full


async def test_prefill_to_decode_with_a_grammar_continues_exactly() -> None:
    grammar = Grammar(kind="json_schema", spec=json.dumps(SCHEMA))
    boot = BootstrapInfo(host="127.0.0.1", port=7100, room=9)
    base = msgspec.structs.replace(
        _steered("x", grammar=grammar, temperature=1.0, seed=4, logit_bias={ord("a"): 0.3}),
        prompt_logprobs=1,
    )
    req = msgspec.structs.replace(base, bootstrap_info=boot)
    async with (
        _engine() as agg,
        _engine(role="prefill", bootstrap_port=7100) as prefill,
        _engine(role="decode") as decode,
    ):
        expected = await collect(agg.generate(base))
        stream = decode.generate(req)
        target = await decode.wait_transfer_target(req.rid)
        first = await collect(prefill.generate(req))
        source = await prefill.wait_transfer_source(req.rid)
        src, dst = prefill.kv_buffer(source.dp_rank), decode.kv_buffer(target.dp_rank)
        for s, d in zip(source.block_ids, target.block_ids, strict=True):
            dst[d] = src[s]  # what a NIXL WRITE does
        assert decode.complete_transfer(req.rid)
        prefill.release_transfer(req.rid)
        decoded = await collect(stream)
    # The prefill's first token is decode's first; the prompt's logprobs are the prefill's.
    assert [t for o in decoded for t in o.token_ids] == [t for o in expected for t in o.token_ids]
    assert first[0].token_ids == decoded[0].token_ids[:1]
    assert first[0].prompt_logprobs == expected[0].prompt_logprobs is not None
    assert all(o.prompt_logprobs is None for o in decoded)
