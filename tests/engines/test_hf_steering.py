"""The ``hf`` engine's structured output, logit_bias, penalties and prompt logprobs on SmolLM2,
and that a migrated request (``generated`` tokens replayed) continues with exactly the tokens of
the uninterrupted run. Few prompts, short outputs: this file runs on two busy cores."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncGenerator, Iterator
from contextlib import AbstractAsyncContextManager, aclosing
from dataclasses import dataclass
from typing import Any

import anyio
import jsonschema_rs
import msgspec
import pytest
import torch

from actors.serving.engines._hf import HFEngine, find_smollm2
from actors.serving.engines._hf._model import load_model
from actors.serving.requests._continuation import continuation
from protocols.engine import (
    EngineOutput,
    Grammar,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from protocols.errors import InvalidRequest
from tests.engines.test_hf_engine import THREADS
from tests.engines.test_hf_engine import started as started_engine

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Model:
    tokenizer: Any
    prompt: list[int]  # a chat prompt asking for a person as JSON
    prompt_logprobs: torch.Tensor  # log_softmax of transformers' own logits over ``prompt``


@pytest.fixture(scope="module")
def model() -> Iterator[Model]:
    from transformers import AutoTokenizer

    threads_before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    files = find_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(str(files.tokenizer_path))
    messages = [{"role": "user", "content": "Describe a person as JSON: name, age, color."}]
    prompt = list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    )
    reference = load_model(files.folder, "cpu")
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt])).logits[0].float()
    del reference
    yield Model(tokenizer, prompt, torch.log_softmax(logits, dim=-1))
    torch.set_num_threads(threads_before)


def started(**kw: Any) -> AbstractAsyncContextManager[HFEngine]:
    """An hf engine for one test, with room for the larger batches here."""
    return started_engine(**{"kv_cache_tokens": 4096, **kw})


def req(
    rid: str,
    prompt: list[int],
    max_tokens: int,
    *,
    grammar: Grammar | None = None,
    **options: Any,
) -> PreprocessedRequest:
    options.setdefault("temperature", 0.0)
    return PreprocessedRequest(
        rid=rid,
        token_ids=prompt,
        stop_conditions=StopConditions(max_tokens=max_tokens),
        sampling_options=SamplingOptions(guided_decoding=grammar, **options),
        eos_token_ids=[2],
    )


async def outputs(stream: AsyncGenerator[EngineOutput, None]) -> list[EngineOutput]:
    async with aclosing(stream) as it:
        return [out async for out in it]


def tokens_of(outs: list[EngineOutput]) -> list[int]:
    return [t for out in outs for t in out.token_ids]


async def test_json_schema_output_always_parses(model: Model) -> None:
    validator = jsonschema_rs.validator_for(SCHEMA)
    grammar = Grammar(kind="json_schema", spec=json.dumps(SCHEMA))
    results: dict[int, list[EngineOutput]] = {}
    async with started(max_running_requests=20) as engine:

        async def one(i: int) -> None:
            r = req(f"r{i}", model.prompt, 80, grammar=grammar, temperature=1.0, seed=i)
            results[i] = await outputs(engine.generate(r))

        async with anyio.create_task_group() as tg:
            for i in range(20):
                tg.start_soon(one, i)
    texts = set()
    for outs in results.values():
        text = model.tokenizer.decode(tokens_of(outs), skip_special_tokens=True)
        assert outs[-1].finish_reason == "stop", text
        validator.validate(json.loads(text))
        texts.add(text)
    assert len(texts) > 10


async def test_regex_ebnf_and_json_object_are_honoured(model: Model) -> None:
    cases = [
        (Grammar(kind="regex", spec=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"), r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
        (Grammar(kind="ebnf", spec='root ::= "red" | "green" | "blue"'), r"red|green|blue"),
    ]
    async with started() as engine:
        for i, (grammar, pattern) in enumerate(cases):
            outs = await outputs(engine.generate(req(f"g{i}", model.prompt, 20, grammar=grammar)))
            text = model.tokenizer.decode(tokens_of(outs), skip_special_tokens=True)
            assert re.fullmatch(pattern, text), text
            assert outs[-1].finish_reason == "stop"
        obj = Grammar(kind="json_object")
        outs = await outputs(engine.generate(req("o", model.prompt, 60, grammar=obj)))
        if outs[-1].finish_reason == "stop":
            text = model.tokenizer.decode(tokens_of(outs), skip_special_tokens=True)
            assert isinstance(json.loads(text), dict)
        else:  # cut by max_tokens: still the start of an object
            assert model.tokenizer.decode(tokens_of(outs)).lstrip().startswith("{")


@pytest.mark.parametrize(
    ("kind", "spec"),
    [("json_schema", '{"type": 12}'), ("regex", "(unclosed"), ("ebnf", "root ::= (")],
)
async def test_an_invalid_grammar_is_refused_at_admission(
    model: Model, kind: str, spec: str
) -> None:
    async with started() as engine:
        grammar = Grammar(kind=kind, spec=spec)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequest, match=f"invalid {kind}"):
            engine.generate(req("bad", model.prompt, 4, grammar=grammar))
        assert engine.is_quiescent()


async def test_logit_bias_bans_and_forces(model: Model) -> None:
    async with started() as engine:
        plain = tokens_of(await outputs(engine.generate(req("p", model.prompt, 6))))
        ban = {plain[0]: -100.0}
        other = tokens_of(await outputs(engine.generate(req("b", model.prompt, 6, logit_bias=ban))))
        assert other[0] != plain[0] and plain[0] not in other
        force = {1234: 100.0}
        forced = await outputs(engine.generate(req("f", model.prompt, 6, logit_bias=force)))
        assert tokens_of(forced) == [1234] * 6
        with pytest.raises(InvalidRequest, match="logit_bias"):
            engine.generate(req("x", model.prompt, 6, logit_bias={10**7: 1.0}))


async def test_prompt_logprobs_are_the_models_over_the_prompt(model: Model) -> None:
    prompt = model.prompt
    # A small batch budget: the prompt prefills in chunks, the logprobs come from every chunk.
    for budget in (2048, 16):
        async with started(max_batch_tokens=budget) as engine:
            r = msgspec.structs.replace(req("p", prompt, 3), prompt_logprobs=2, logprobs=0)
            outs = await outputs(engine.generate(r))
        first = outs[0].prompt_logprobs
        assert first is not None and len(first) == len(prompt) - 1
        assert all(out.prompt_logprobs is None for out in outs[1:])
        want = model.prompt_logprobs
        for i, lp in enumerate(first):
            assert lp.logprob == pytest.approx(float(want[i, prompt[i + 1]]), abs=1e-3)
            assert len(lp.top_ids) == 2
            assert lp.top_ids[0] == int(torch.argmax(want[i]))


async def test_prefill_worker_sends_the_prompt_logprobs(model: Model) -> None:
    async with started() as prefill, started() as decode:
        r = msgspec.structs.replace(req("d", model.prompt, 4), prompt_logprobs=0)
        kv = await prefill.prefill(r)
        assert kv.prompt_logprobs is not None and len(kv.prompt_logprobs) == len(model.prompt) - 1
        outs = await outputs(decode.generate_from_kv(r, kv.pages, kv.first_token))
        assert all(out.prompt_logprobs is None for out in outs)


def _options(case: str) -> dict[str, Any]:
    grammar = Grammar(kind="json_schema", spec=json.dumps(SCHEMA))
    return {
        "grammar-greedy": {"grammar": grammar},
        "grammar-sampled": {"grammar": grammar, "temperature": 0.8, "seed": 5},
        "penalties": {
            "temperature": 0.9,
            "seed": 11,
            "presence_penalty": 0.8,
            "frequency_penalty": 0.5,
            "repetition_penalty": 1.3,
            "logit_bias": {28: 2.0, 1234: -100.0},
        },
    }[case]


@pytest.mark.parametrize("case", ["grammar-greedy", "grammar-sampled", "penalties"])
async def test_a_continuation_produces_the_rest_of_the_uninterrupted_run(
    model: Model, case: str
) -> None:
    original = msgspec.structs.replace(req("orig", model.prompt, 24, **_options(case)), logprobs=1)
    async with started() as engine:
        outs = await outputs(engine.generate(original))
        full = tokens_of(outs)
        full_lps = [lp for out in outs for lp in out.logprobs or ()]
        assert len(full) > 4
        for k in (1, len(full) // 2, len(full) - 1):
            cont = continuation(original, full[:k], f"c{k}")
            rest_outs = await outputs(engine.generate(cont))
            assert full[:k] + tokens_of(rest_outs) == full, k
            assert rest_outs[-1].finish_reason == outs[-1].finish_reason
            rest_lps = [lp for out in rest_outs for lp in out.logprobs or ()]
            for got, want in zip(rest_lps, full_lps[k:], strict=True):
                assert got.top_ids == want.top_ids
                assert got.logprob == pytest.approx(want.logprob, abs=1e-3)
