"""Helpers of the parser tests: feed a text in pieces, gather what the stream and the result say."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterator
from typing import Any

import msgspec

from actors.serving.frontend._parsers import OutputParser


@dataclasses.dataclass
class Streamed:
    """What a streaming client puts together from the deltas, and the non-streaming result."""

    content: str
    reasoning: str
    calls: list[dict[str, Any]]  # per index: id, name, arguments (concatenated)
    made: bool
    result_content: str | None
    result_reasoning: str | None
    result_calls: list[tuple[str, Any]]  # name, parsed arguments

    def same_as(self, other: Streamed) -> bool:
        mine = [(c["name"], c["arguments"]) for c in self.calls]
        theirs = [(c["name"], c["arguments"]) for c in other.calls]
        return (
            self.content,
            self.reasoning,
            mine,
            self.made,
            self.result_content,
            self.result_reasoning,
            self.result_calls,
        ) == (
            other.content,
            other.reasoning,
            theirs,
            other.made,
            other.result_content,
            other.result_reasoning,
            other.result_calls,
        )


def feed(parser: OutputParser, pieces: list[str]) -> Streamed:
    content, reasoning = [], []
    calls: list[dict[str, Any]] = []
    deltas = [parser.feed(piece) for piece in pieces]
    deltas.append(parser.finish())
    for delta in deltas:
        content.append(delta.content)
        reasoning.append(delta.reasoning_content)
        for call in delta.tool_calls:
            wire = msgspec.to_builtins(call)  # the JSON a client gets
            if "id" in wire:
                assert wire["index"] == len(calls)
                assert wire["type"] == "function" and wire["id"].startswith("call_")
                calls.append({"id": wire["id"], "name": wire["function"]["name"], "arguments": ""})
            else:
                assert set(wire) == {"index", "function"} and set(wire["function"]) == {"arguments"}
            calls[wire["index"]]["arguments"] += wire["function"]["arguments"]
    result_calls = [(c.function.name, json.loads(c.function.arguments)) for c in parser.tool_calls]
    return Streamed(
        "".join(content),
        "".join(reasoning),
        calls,
        parser.tool_calls_made,
        parser.content,
        parser.reasoning_content,
        result_calls,
    )


def splits(text: str, seed: int = 0) -> Iterator[list[str]]:
    """The text whole, in two at every position, one character at a time, and in random
    pieces of 1 to 7 characters."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(20):
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(1, 7)
            pieces.append(text[i : i + n])
            i += n
        yield pieces
