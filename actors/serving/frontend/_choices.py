"""One request's choices: each its own engine request, state and renderer, the per-chunk loop
that streams one, the ``best_of`` pick and the usage over all of them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from protocols.engine import EngineOutput, PreprocessedRequest, Usage
from protocols.errors import StreamIncomplete

from ._backend import ModelInfo
from ._chunks import ChatRenderer, Renderer
from ._mapping import choice_requests
from ._parsers import OutputParser, ParsedDelta
from ._pipeline import Choice
from ._streams import STREAM_ENDED, ready_output

__all__ = ["Part", "best", "choice_parts", "pump", "usage_of"]


class Part:
    """One choice of a request: its engine request, its state, its renderer, and the text it
    begins with (the echoed prompt)."""

    __slots__ = ("choice", "echo", "first", "parser", "preq", "renderer", "result")

    def __init__(
        self,
        preq: PreprocessedRequest,
        choice: Choice,
        renderer: Renderer[Any],
        echo: str,
        *,
        first: bool,
    ) -> None:
        self.preq = preq
        self.choice = choice
        self.renderer = renderer
        self.echo = echo
        self.first = first  # the first choice of its prompt (usage counts each prompt once)
        self.result: tuple[str, str] | None = None  # the whole text and finish (non-streaming)
        # Reads tool calls and reasoning out of a chat answer; None: plain text (the fast path).
        self.parser: OutputParser | None = None

    def delta(self) -> Callable[[str, str | None], bytes]:
        """The frame of a text delta of this choice, and its finish reason on the last."""
        renderer, choice, parser = self.renderer, self.choice, self.parser
        if parser is not None:
            assert isinstance(renderer, ChatRenderer)
            return parsed_delta(parser, renderer, choice)
        if not choice.wants_logprobs:
            return renderer.delta

        def delta(text: str, finish_reason: str | None) -> bytes:
            # Each frame with the logprobs of the tokens since the last.
            return renderer.delta(text, finish_reason, choice.take_logprobs())

        return delta


def parsed_delta(
    parser: OutputParser, renderer: ChatRenderer, choice: Choice
) -> Callable[[str, str | None], bytes]:
    """The frames of a choice whose text goes through ``parser``: its content, reasoning and
    tool-call deltas, and ``tool_calls`` as the finish reason of an answer that stopped after
    sending calls."""

    def delta(text: str, finish_reason: str | None) -> bytes:
        parsed = parser.feed(text) if text else ParsedDelta()
        if finish_reason is not None:
            tail = parser.finish()
            parsed.content += tail.content
            parsed.reasoning_content += tail.reasoning_content
            parsed.tool_calls += tail.tool_calls
            if finish_reason == "stop" and parser.tool_calls_made:
                finish_reason = "tool_calls"
        return renderer.parsed(parsed, finish_reason, choice.take_logprobs())

    return delta


def choice_parts(
    info: ModelInfo,
    prompts: list[tuple[PreprocessedRequest, str]],
    copies: int,
    renderer: Callable[[int], Renderer[Any]],
    *,
    logprobs: bool,
    echo: bool = False,
    ranked: bool = False,
) -> list[Part]:
    """The choices of a request: ``copies`` of each prompt's engine request (with the text its
    choices begin with), of indexes ``prompt * copies + j``; one choice keeps its request as it
    is (its rid the response's id)."""
    tokenizer = info.tokenizer
    parts: list[Part] = []
    for p, (preq, text) in enumerate(prompts):
        indexes = range(p * copies, (p + 1) * copies)
        single = len(prompts) == 1 and copies == 1
        own_requests = [preq] if single else choice_requests(preq, indexes)
        for index, own in zip(indexes, own_requests, strict=True):
            stop = own.stop_conditions
            choice = Choice(
                tokenizer.detokenizer(own.token_ids),
                prompt_tokens=len(own.token_ids),
                stop=stop.stop or (),
                min_tokens=stop.min_tokens or 0,
                logprobs=tokenizer if logprobs else None,
                echo=own.token_ids if echo else None,
                ranked=ranked,
            )
            parts.append(Part(own, choice, renderer(index), text, first=index == indexes[0]))
    return parts


def best(parts: list[Part], n: int) -> list[Part]:
    """The choices a response returns, in index order: of each prompt's, the ``n`` of the
    highest logprob sum (``best_of``), or all of them."""
    if len(parts) == 1:
        return parts
    groups: list[list[Part]] = []
    for part in parts:
        if part.first:
            groups.append([])
        groups[-1].append(part)
    return [
        part
        for group in groups
        for part in (
            group
            if len(group) == n
            else sorted(group, key=lambda p: p.choice.logprob_sum, reverse=True)[:n]
        )
    ]


async def pump(
    part: Part,
    outputs: AsyncIterator[EngineOutput],
    text: str,
    finish: str | None,
    frames: list[bytes],
    send: Callable[[bytes], Awaitable[None]],
    tokens: Callable[[int], None],
) -> None:
    """Stream one choice, from its first output's ``text`` and ``finish`` on: its frames go to
    ``send`` as they come, those of outputs already here together; the last ones (those not
    sent when it raises) are left in ``frames``.

    This is the per-chunk loop: its callables looked up once, the iterator's ``__anext__``
    awaited directly (``next_output``'s check is the ``except`` below).
    """
    start = part.renderer.start()
    if start is not None:
        frames.append(start)
    text = part.echo + text
    delta = part.delta()
    if text or finish is not None:
        frames.append(delta(text, finish))
    ready, receive, on_output = ready_output(outputs), outputs.__anext__, part.choice.on_output
    try:
        while finish is None:
            out = ready()
            if out is None:
                if frames:
                    await send(b"".join(frames))
                    frames.clear()
                out = await receive()
            text, finish = on_output(out)
            tokens(len(out.token_ids))
            if text or finish is not None:
                frames.append(delta(text, finish))
    except StopAsyncIteration:
        raise StreamIncomplete(STREAM_ENDED) from None


def usage_of(parts: Sequence[Part]) -> Usage:
    """The usage of a request: every choice's completion tokens, each prompt once."""
    if len(parts) == 1:
        return parts[0].choice.final_usage()
    usages = [part.choice.final_usage() for part in parts]
    firsts = [usage for part, usage in zip(parts, usages, strict=True) if part.first]
    cached = [usage.cached_tokens for usage in firsts]
    return Usage(
        prompt_tokens=sum(usage.prompt_tokens for usage in firsts),
        completion_tokens=sum(usage.completion_tokens for usage in usages),
        cached_tokens=None if None in cached else sum(c for c in cached if c is not None),
    )
