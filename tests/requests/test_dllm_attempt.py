"""An attempt's rules for a block-diffusion (``dllm``) model's outputs, on a scripted reply
stream: an output with neither tokens nor a finish is a typed, migratable ``EmptyOutput`` (a
chat model's attempt skips it), a draining worker's offer is not one, and what the request has
so far (whole blocks) is what its continuation replays."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import Any, cast

import anyio.lowlevel
import pytest

from actors.serving.requests import StreamOptions
from actors.serving.requests._attempt import Attempt, Progress
from actors.serving.requests._continuation import continuation
from actors.serving.routing import Routed
from protocols.engine import (
    BootstrapInfo,
    EngineOutput,
    ModelKind,
    PreprocessedRequest,
    StopConditions,
    Usage,
)
from protocols.errors import EmptyOutput, EngineFailure, RequestError, error_from_wire

PROMPT = list(range(50, 60))
FIRST = list(range(1000, 1008))
SECOND = list(range(2000, 2008))


class _Script:
    """A reply stream that hands out a fixed list of outputs, then ends."""

    def __init__(self, outputs: Iterable[EngineOutput]) -> None:
        self._left = deque(outputs)

    @property
    def buffered(self) -> int:
        return len(self._left)

    def receive_nowait(self) -> EngineOutput:
        return self._left.popleft()

    async def receive(self, timeout: float) -> EngineOutput:
        await anyio.lowlevel.checkpoint()
        if not self._left:
            raise StopAsyncIteration
        return self._left.popleft()

    def close(self) -> None:
        self._left.clear()


def _request() -> PreprocessedRequest:
    return PreprocessedRequest(
        rid="r", token_ids=PROMPT, stop_conditions=StopConditions(max_tokens=16)
    )


def _attempt(kind: ModelKind, outputs: Iterable[EngineOutput]) -> Attempt:
    request = _request()
    return Attempt(
        Routed("decode-0", cast(Any, None)),
        request,
        cast(Any, _Script(outputs)),
        Progress(request, time.monotonic() + 60),
        model="dllm-test",
        stall_timeout=5.0,
        request_timeout=60.0,
        kind=kind,
    )


def _blocks_with_a_gap() -> list[EngineOutput]:
    usage = Usage(prompt_tokens=len(PROMPT), completion_tokens=16)
    return [
        EngineOutput(token_ids=FIRST),
        EngineOutput(),  # neither tokens nor a finish
        EngineOutput(token_ids=SECOND, finish_reason="length", usage=usage),
    ]


async def test_a_chat_attempt_skips_an_empty_output() -> None:
    attempt = _attempt("chat", _blocks_with_a_gap())
    assert (await attempt.receive()).token_ids == FIRST
    last = await attempt.receive()
    assert last.token_ids == SECOND and last.finish_reason == "length" and attempt.finished
    assert attempt.progress.generated == FIRST + SECOND


async def test_a_dllm_attempt_fails_an_empty_output_as_migratable() -> None:
    attempt = _attempt("dllm", _blocks_with_a_gap())
    assert (await attempt.receive()).token_ids == FIRST
    with pytest.raises(EmptyOutput) as caught:
        await attempt.receive()
    error = caught.value
    assert isinstance(error, EngineFailure) and error.migratable
    assert error.code == "backend.empty_output" and "decode-0" in error.message
    assert not attempt.finished
    # The continuation replays the prompt and the whole blocks the client has.
    assert attempt.progress.generated == FIRST
    again = continuation(attempt.progress.original, attempt.progress.generated, "r-m1")
    assert again.token_ids == PROMPT + FIRST and again.generated == len(FIRST)
    assert again.stop_conditions.max_tokens == 16 - len(FIRST)


def test_a_dllm_attempt_fails_an_empty_output_already_buffered() -> None:
    attempt = _attempt("dllm", _blocks_with_a_gap())
    assert (out := attempt.receive_nowait()) is not None and out.token_ids == FIRST
    with pytest.raises(EmptyOutput):
        attempt.receive_nowait()


async def test_a_dllm_attempt_takes_a_drain_offer_and_an_empty_finish() -> None:
    offer = EngineOutput(disaggregated_params=BootstrapInfo(host="127.0.0.1", port=1, room=2))
    ending = EngineOutput(finish_reason="stop", usage=Usage(prompt_tokens=10, completion_tokens=8))
    attempt = _attempt("dllm", [EngineOutput(token_ids=FIRST), offer, ending])
    assert (await attempt.receive()).token_ids == FIRST
    last = await attempt.receive()  # the offer is noted, not an error; the finish ends it
    assert last.finish_reason == "stop" and attempt.offer is not None
    assert last.usage is not None and last.usage.completion_tokens == len(FIRST)


def test_the_error_crosses_the_wire_and_streams_default_to_chat() -> None:
    rebuilt = error_from_wire(*EmptyOutput("no block").to_wire())
    assert type(rebuilt) is EmptyOutput and rebuilt.message == "no block"
    assert isinstance(rebuilt, RequestError) and rebuilt.http_status == 500
    assert StreamOptions().kind == "chat"
    assert StreamOptions(kind="dllm").kind == "dllm"
