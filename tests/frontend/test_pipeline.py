"""From engine outputs to client text: stop strings, finish reasons, usage."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from actors.serving.frontend import ByteTokenizer
from actors.serving.frontend._chunks import (
    ChatRenderer,
    CompletionRenderer,
    _ChatChunkChoice,
    _ChatDelta,
)
from actors.serving.frontend._metrics import LoopHistogram
from actors.serving.frontend._pipeline import Choice, StopMatcher
from protocols.engine import EngineOutput, TokenLogprob, Usage
from protocols.errors import EngineFailure, RequestCancelled


def _feed(matcher: StopMatcher, pieces: list[str]) -> tuple[str, bool]:
    out = []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out.append(text)
        if stopped:
            return "".join(out), True
    out.append(matcher.release())
    return "".join(out), False


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def test_stop_string_split_across_outputs_is_cut_and_never_sent() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("The answer. S") == ("The answer. ", False)  # "S" held back
    assert matcher.feed("TO") == ("", False)
    assert matcher.feed("P and more") == ("", True)


def test_held_prefix_is_released_when_it_is_not_a_stop() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("ST") == ("", False)
    assert matcher.feed("AY") == ("STAY", False)
    assert matcher.feed("x S") == ("x ", False)
    assert matcher.release() == "S"


def test_earliest_of_several_stops_wins() -> None:
    assert StopMatcher(["world", "lo w"]).feed("hello world") == ("hel", True)


@given(
    st.text(alphabet="abST OP", max_size=40),
    st.lists(st.sampled_from(["STOP", "OP S", "a", "bb"]), min_size=1, max_size=3),
    st.lists(st.integers(min_value=0, max_value=50), max_size=10),
)
def test_streamed_matching_equals_whole_text_matching(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    cut = min((i for i in (text.find(s) for s in stops) if i != -1), default=-1)
    expected = (text, False) if cut == -1 else (text[:cut], True)
    assert _feed(StopMatcher(stops), _split(text, cuts)) == expected


@given(
    st.text(alphabet="abab", max_size=30),
    st.lists(st.text(alphabet="ab", min_size=1, max_size=6), min_size=1, max_size=4),
    st.lists(st.integers(min_value=0, max_value=30), max_size=8),
)
def test_held_back_text_is_the_longest_tail_that_may_still_become_a_stop(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    matcher = StopMatcher(stops)
    seen = sent = ""
    for piece in _split(text, cuts):
        out, found = matcher.feed(piece)
        if found:
            return
        seen += piece
        sent += out
        longest = max(
            (k for s in stops for k in range(1, len(s)) if seen.endswith(s[:k])), default=0
        )
        assert sent == seen[: len(seen) - longest]


def test_long_stop_strings_cost_time_linear_in_the_output() -> None:
    # Fifteen long stop strings that never match, and one whose first half the output keeps
    # repeating, so a long tail stays held back: a per-output rescan of every prefix of every
    # stop string would take minutes here (the test's watchdog), the automaton takes no time.
    never = [f"{i:02d}" + "x" * 4000 for i in range(15)]
    held = "ab" * 2000 + "!"
    matcher = StopMatcher([*never, held])
    sent = []
    for _ in range(2000):
        out, found = matcher.feed("ab")
        assert not found
        sent.append(out)
    assert "".join(sent) == ""  # all 4000 characters may still be the held stop string
    out, found = matcher.feed("!")
    assert (out, found) == ("", True)


def _choice(stop: list[str] | None = None, min_tokens: int = 0) -> Choice:
    tok = ByteTokenizer()
    return Choice(tok.detokenizer([]), prompt_tokens=7, stop=stop or [], min_tokens=min_tokens)


def _ids(text: str) -> list[int]:
    return list(text.encode())


def test_choice_passes_finish_reason_and_engine_usage() -> None:
    choice = _choice()
    assert choice.on_output(EngineOutput(token_ids=_ids("ab"))) == ("ab", None)
    usage = Usage(prompt_tokens=7, completion_tokens=3, cached_tokens=4)
    out = EngineOutput(token_ids=_ids("c"), finish_reason="length", usage=usage)
    assert choice.on_output(out) == ("c", "length")
    assert choice.final_usage() == usage


def test_choice_counts_usage_itself_when_a_stop_string_ends_it() -> None:
    choice = _choice(["STOP"])
    assert choice.on_output(EngineOutput(token_ids=_ids("one ST"))) == ("one ", None)
    assert choice.on_output(EngineOutput(token_ids=_ids("OP two"))) == ("", "stop")
    assert choice.final_usage() == Usage(prompt_tokens=7, completion_tokens=12)


def test_stop_strings_wait_for_min_tokens() -> None:
    choice = _choice(["a"], min_tokens=4)
    assert choice.on_output(EngineOutput(token_ids=_ids("aa"))) == ("aa", None)
    assert choice.on_output(EngineOutput(token_ids=_ids("bab"))) == ("b", "stop")


def test_held_text_is_sent_when_the_engine_finishes() -> None:
    choice = _choice(["STOP"])
    assert choice.on_output(EngineOutput(token_ids=_ids("end ST"))) == ("end ", None)
    assert choice.on_output(EngineOutput(finish_reason="stop")) == ("ST", "stop")


def test_engine_error_and_server_abort_raise_typed_errors() -> None:
    with pytest.raises(EngineFailure, match="boom"):
        _choice().on_output(EngineOutput(finish_reason="error", error="boom"))
    with pytest.raises(RequestCancelled):
        _choice().on_output(EngineOutput(finish_reason="cancelled"))


@given(st.text(), st.sampled_from([None, "stop", "length"]), st.booleans(), st.integers(0, 127))
def test_delta_frames_are_the_chunk_encoded_whole(
    text: str, finish: str | None, include_usage: bool, index: int
) -> None:
    """A delta's frame (from the renderer's template when it can) has the bytes of its whole
    chunk encoded at once, whatever its choice's index."""
    for renderer in (
        CompletionRenderer("cmpl-1", 'mo"del\x00', 7, include_usage=include_usage, index=index),
        ChatRenderer("chatcmpl-1", "m\x00", 7, include_usage=include_usage, index=index),
    ):
        frame = renderer.delta(text, finish)
        assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
        chunk = json.loads(frame[6:])
        choice = chunk["choices"][0]
        assert (choice["index"], choice["finish_reason"]) == (index, finish)
        got = choice["text"] if "text" in choice else choice["delta"].get("content", "")
        assert got == text
        assert ("usage" in chunk) == include_usage
        whole = (
            renderer._frame_of(text, finish)
            if isinstance(renderer, CompletionRenderer)
            else renderer._chunk(_chat_choice(index, text, finish))
        )
        assert frame == whole


def _chat_choice(index: int, text: str, finish: str | None) -> Any:
    delta = _ChatDelta(content=text) if text else _ChatDelta()
    return _ChatChunkChoice(index, delta, None, finish)


@given(st.lists(st.floats(min_value=0, max_value=10, allow_nan=False), max_size=50))
def test_loop_histogram_exposes_what_prometheus_clients_histogram_does(
    samples: list[float],
) -> None:
    # Bounds hit exactly (le is inclusive), between, and past the last one.
    samples = [*samples, 0.0001, 0.001, 2.5, 11.0]
    buckets = (0.0001, 0.00025, 0.001, 0.01, 1, 2.5)
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("x_seconds", "doc", ["model"], buckets=buckets, registry=theirs)
    loop = LoopHistogram("x_seconds", "doc", "model", buckets, ours)
    for sample in samples:
        reference.labels("m").observe(sample)
        loop.labels("m").observe(sample)

    def lines(registry: CollectorRegistry) -> list[str]:
        text = generate_latest(registry).decode()
        return [line for line in text.splitlines() if "_created" not in line]

    assert lines(ours) == lines(theirs)


def test_echo_needs_the_prompts_logprobs_from_the_engine() -> None:
    tokenizer = ByteTokenizer()
    prompt = tokenizer.encode("hi")
    choice = Choice(tokenizer.detokenizer(prompt), prompt_tokens=3, logprobs=tokenizer, echo=prompt)
    with pytest.raises(EngineFailure, match="no logprobs of the prompt"):
        choice.on_output(EngineOutput(token_ids=[72], logprobs=[TokenLogprob(-1.0)]))


def test_a_ranked_choice_sums_its_logprobs_and_shows_none() -> None:
    tokenizer = ByteTokenizer()
    choice = Choice(tokenizer.detokenizer([]), prompt_tokens=1, ranked=True)
    choice.on_output(EngineOutput(token_ids=[72, 105], logprobs=[TokenLogprob(-1.0)] * 2))
    choice.on_output(EngineOutput(token_ids=[33], logprobs=[TokenLogprob(-0.5)]))
    assert choice.logprob_sum == -2.5
    assert choice.take_logprobs() is None
