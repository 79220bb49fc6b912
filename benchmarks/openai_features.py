"""What the OpenAI features cost on the ``hf`` engine (SmolLM2-135M-Instruct), served.

    python -m benchmarks.openai_features [--quick] [--rounds N] [--max-tokens N]

The serving tree of ``actorserve run --backend hf --mode aggregated`` (one worker) with its root
in this process, driven over HTTP with ``/v1/chat/completions`` (not streamed), one request at a
time. Four kinds of request over the same prompts, interleaved round by round so that the
machine's drift weighs on each alike:

- ``plain``: sampled (temperature 0.7, a seed), ``max_tokens`` tokens with ``ignore_eos``;
- ``logprobs``: the same with ``logprobs`` and ``top_logprobs: 5``;
- ``json_schema``: the same with a strict ``response_format`` JSON schema (the grammar's mask on
  every step; the output ends where the schema's object does, so it may be shorter);
- ``n4``: the same with ``n: 4``: four choices, batched by the engine, sharing the prompt;
- ``batch4``: four plain requests at once: what the engine's batching gives four streams, the
  ceiling for ``n4`` on this machine.

Each kind's tokens/s is its completion tokens over its wall time. Goals: logprobs and the grammar
mask cost at most 10 % of plain's tokens/s (ratios ≥ 0.9); ``n4`` gives at least 2.5x plain's.
Every JSON-schema answer is checked to parse. A table first, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Any

import anyio
import httpx

from actors.serving import ServeConfig
from benchmarks._common import report, served_tree

QUESTIONS = [
    "Describe a lighthouse keeper's day.",
    "List some facts about volcanoes.",
    "Write about a city in the rain.",
    "Explain how bread is made.",
]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "facts": {"type": "array", "items": {"type": "string"}},
        "rating": {"type": "integer"},
    },
    "required": ["title", "facts", "rating"],
    "additionalProperties": False,
}
KINDS: dict[str, dict[str, Any]] = {
    "plain": {},
    "logprobs": {"logprobs": True, "top_logprobs": 5},
    "json_schema": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
        }
    },
    "n4": {"n": 4},
    "batch4": {},
}
#: Requests of a kind sent at once.
AT_ONCE = {"batch4": 4}


@dataclass
class Tally:
    tokens: int = 0
    seconds: float = 0.0
    requests: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


async def _one(
    client: httpx.AsyncClient, model: str, question: str, kind: str, max_tokens: int, seed: int
) -> int:
    """One request of ``kind``: its completion tokens."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": seed,
        **KINDS[kind],
    }
    if kind != "json_schema":
        body["ignore_eos"] = True
    response = await client.post("/v1/chat/completions", json=body)
    response.raise_for_status()
    answer = response.json()
    if kind == "json_schema":
        for choice in answer["choices"]:
            if choice["finish_reason"] == "stop":
                json.loads(choice["message"]["content"])  # a cut-off answer cannot parse
    if kind == "logprobs":
        assert all(c["logprobs"]["content"] for c in answer["choices"])
    return int(answer["usage"]["completion_tokens"])


async def measure(rounds: int, max_tokens: int) -> dict[str, Tally]:
    config = ServeConfig(backend="hf", mode="aggregated", decode_workers=1, port=0)
    tallies = {kind: Tally() for kind in KINDS}
    async with served_tree(config) as serving:
        url = f"http://127.0.0.1:{serving.port}"
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            for kind in KINDS:  # warm-up: each path (and the grammar's vocabulary) once
                await _one(client, config.model, QUESTIONS[0], kind, 4, 0)
            for r in range(rounds):
                for kind, tally in tallies.items():
                    question = QUESTIONS[r % len(QUESTIONS)]
                    start = time.perf_counter()
                    async with anyio.create_task_group() as tg:
                        for j in range(AT_ONCE.get(kind, 1)):
                            seed = r * 4 + j
                            tg.start_soon(
                                _count,
                                tally,
                                client,
                                config.model,
                                question,
                                kind,
                                max_tokens,
                                seed,
                            )
                    tally.seconds += time.perf_counter() - start
    return tallies


async def _count(
    tally: Tally,
    client: httpx.AsyncClient,
    model: str,
    question: str,
    kind: str,
    max_tokens: int,
    seed: int,
) -> None:
    tokens = await _one(client, model, question, kind, max_tokens, seed)
    tally.tokens += tokens
    tally.requests += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 24 tokens")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    rounds, max_tokens = (3, 24) if args.quick else (args.rounds, args.max_tokens)
    tallies = anyio.run(measure, rounds, max_tokens)
    plain = tallies["plain"].tokens_per_s
    rows: list[tuple[str, Any, str]] = []
    for kind, tally in tallies.items():
        ratio = tally.tokens_per_s / plain if plain else 0.0
        note = f"x{ratio:.3f} of plain; {tally.tokens} tokens in {tally.seconds:.2f} s"
        rows.append((f"{kind} tokens/s", round(tally.tokens_per_s, 2), note))
    result: dict[str, Any] = {
        "benchmark": "openai_features",
        "rounds": rounds,
        "max_tokens": max_tokens,
        **{f"tok_per_s_{kind}": round(t.tokens_per_s, 2) for kind, t in tallies.items()},
        **{
            f"ratio_{kind}": round(t.tokens_per_s / plain, 3) if plain else 0.0
            for kind, t in tallies.items()
            if kind != "plain"
        },
        # How much of what batching four streams gives this machine n = 4 gets.
        "n4_of_batch4": round(tallies["n4"].tokens_per_s / tallies["batch4"].tokens_per_s, 3),
    }
    report("OpenAI features on the hf engine (chat, one request at a time)", rows, result)


if __name__ == "__main__":
    main()
