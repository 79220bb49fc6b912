"""A request's start: its request stream is started with the request in its mailbox and routes
from the routing view itself. A consumer that gives up before the stream took the request still
ends it (the stream sees its :class:`~actors.serving.RequestOutputs` closed), and the in-flight
counts the routing view keeps come back to zero however requests end. Disaggregated, the
client's first token is the prefill's (before any KV reached decode), and goes with the request
when it migrates."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from typing import Any

import anyio
import httpx
import pytest

from actors import Actor, ReplyError, current_registry
from actors.serving import ModelService, ServedModel
from actors.serving.frontend import ModelInfo
from actors.serving.requests import Admission, RequestOutputs, open_request
from actors.serving.requests._outputs import NextAttempt
from actors.testing import hang
from protocols import PreprocessedRequest, SamplingOptions, StopConditions
from protocols.errors import RequestTimeout
from supervisors import ChildSpec, SupervisorFlags, SupervisorRef, open_supervisor
from tests.helpers.serving import Tree, serving_tree
from tests.serving.test_disaggregated import DISAGG, _quiet
from tests.serving.test_e2e import _stream_text


def _streams(tree: Tree) -> SupervisorRef:
    ref = current_registry().whereis(tree.serving.model().streams_name)
    assert ref is not None
    return SupervisorRef(ref)


def _service(tree: Tree) -> ModelService:
    model = ModelInfo("mock", 4096, tree.serving.model().tokenizer)
    timeout = tree.serving.config.request_timeout
    served = ServedModel(model, _streams(tree), tree.serving.model().table, timeout)
    return ModelService([served])


def _request(rid: str, max_tokens: int = 200) -> PreprocessedRequest:
    return PreprocessedRequest(
        rid=rid,
        token_ids=list(b"a request that is cancelled early " * 4),
        stop_conditions=StopConditions(max_tokens=max_tokens),
        sampling_options=SamplingOptions(temperature=0.0),
    )


async def _settled(tree: Tree) -> None:
    """No request stream left, nothing counted in flight on any worker, engines idle."""
    streams = _streams(tree)
    with anyio.fail_after(15):
        while await streams.which_children():
            await anyio.sleep(0.01)
        while any(w.active for w in tree.serving.model().table.workers.values()):
            await anyio.sleep(0.01)
    await _quiet(tree)


async def test_a_stream_whose_consumer_gave_up_before_it_ran_ends_at_once() -> None:
    async with serving_tree(mode="aggregated", decode_workers=1) as tree:
        streams, admission = _streams(tree), tree.serving.admission
        outputs = open_request(
            streams, tree.serving.model().table, admission, _request("gone"), timeout=600.0
        )
        outputs.close()  # the consumer gives up before the stream has run
        assert admission.inflight == 0
        with pytest.raises(ReplyError):
            await streams.start_dynamic_ask(NextAttempt(outputs))
        assert outputs.owner is not None  # it took the request, saw it closed, ended
        await _settled(tree)
        stats = await tree.engine_stats("decode-0")
        assert stats.prefill_tokens == 0  # never sent to the engine


@pytest.mark.parametrize("mode", ["aggregated", "disaggregated"])
async def test_a_consumer_cancelled_while_its_stream_starts_leaves_nothing(mode: str) -> None:
    config: dict[str, Any] = DISAGG if mode == "disaggregated" else {"mode": mode}
    async with serving_tree(**config, engine_args={"timing": {"speedup": 1.0}}) as tree:
        service = _service(tree)
        for i in range(20):
            outputs = service.generate("mock", _request(f"c{i}"))
            # Cancelled at its first wait: in the start, before or after the stream took it.
            with anyio.move_on_after(0):
                await outputs.__anext__()
            outputs.close()
        await _settled(tree)


@pytest.mark.parametrize("mode", ["aggregated", "disaggregated"])
async def test_in_flight_counts_come_back_to_zero(mode: str) -> None:
    config: dict[str, Any] = {**DISAGG, "decode_workers": 2} if mode == "disaggregated" else {}
    config.setdefault("mode", mode)
    async with serving_tree(**{"decode_workers": 2, **config}, router="least_loaded") as tree:
        async with httpx.AsyncClient(base_url=tree.url) as client:
            results: list[dict[str, Any]] = []

            async def one(i: int) -> None:
                results.append(await _stream_text(client, f"count me {i}", 16))

            async with anyio.create_task_group() as tg:
                for i in range(12):
                    tg.start_soon(one, i)
        assert all(r["error"] is None and r["finish"] == "length" for r in results)
        await _settled(tree)


async def _first_chunk_then(
    tree: Tree, prompt: str, max_tokens: int, after_first: Any
) -> dict[str, Any]:
    """A streamed completion whose first chunk runs ``after_first()`` (awaited) before reading
    on (or going away, if it returns true): the text, finish reason, usage and error."""
    body = {
        "model": "mock",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, finish, usage, error, first = "", None, None, None, True
    # Gone by a cancellation, as a client that disconnects (a break would leave httpx's
    # generators to the garbage collector).
    with anyio.CancelScope() as gone:
        async with httpx.AsyncClient(base_url=tree.url) as client:
            async with client.stream("POST", "/v1/completions", json=body, timeout=60) as response:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    error = event.get("error") or error
                    for choice in event.get("choices", []):
                        text += choice.get("text") or ""
                        finish = choice.get("finish_reason") or finish
                    usage = event.get("usage") or usage
                    if first and text:
                        first = False
                        if await after_first():
                            gone.cancel()
    return {"text": text, "finish": finish, "usage": usage, "error": error}


async def _decode_pids(tree: Tree) -> dict[str, int]:
    return {
        w: (await tree.engine_stats(w)).pid for w, r in tree.serving.roles.items() if r == "decode"
    }


def _routed_decode(tree: Tree) -> str:
    [worker] = [
        w.id for w in tree.serving.model().table.workers.values() if w.role == "decode" and w.active
    ]
    return worker


PROMPT = "the first token comes from the prefill worker " * 3


async def test_the_first_token_comes_from_prefill_and_migrates_with_the_request() -> None:
    async with serving_tree(mode="aggregated", decode_workers=1) as agg:
        async with httpx.AsyncClient(base_url=agg.url) as client:
            expected = await _stream_text(client, PROMPT, 24)
    async with serving_tree(**DISAGG) as tree:
        pids = await _decode_pids(tree)
        for pid in pids.values():  # no KV can land, no decode step can run
            os.kill(pid, signal.SIGSTOP)
        try:

            async def kill_the_routed_decode() -> bool:
                # The first token is here with both decode workers stopped: the prefill's. The
                # routed decode worker dies before its own first output; the request migrates
                # with that token counted as generated.
                victim = _routed_decode(tree)
                os.kill(pids[victim], signal.SIGKILL)
                for worker, pid in pids.items():
                    if worker != victim:
                        os.kill(pid, signal.SIGCONT)
                return False

            got = await _first_chunk_then(tree, PROMPT, 24, kill_the_routed_decode)
        finally:
            for pid in pids.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        assert got["error"] is None, got["error"]
        assert got["text"] == expected["text"]
        assert got["finish"] == "length"
        assert got["usage"]["completion_tokens"] == 24
        await tree.wait_ready()
        await _settled(tree)


async def test_a_cancel_after_the_prefills_first_token_frees_both_sides() -> None:
    async with serving_tree(**DISAGG) as tree:
        pids = await _decode_pids(tree)
        for pid in pids.values():
            os.kill(pid, signal.SIGSTOP)
        try:

            async def cancel() -> bool:
                return True  # the client goes away, the decode side still waits for the KV

            got = await _first_chunk_then(tree, PROMPT, 24, cancel)
        finally:
            for pid in pids.values():
                os.kill(pid, signal.SIGCONT)
        assert got["text"] and got["finish"] is None
        await _settled(tree)


async def test_a_hung_stream_actor_cannot_hold_its_client_past_the_deadline() -> None:
    # No ask on a request's path waits for ever: the consumer's ask for the next attempt waits
    # out the request's deadline (and a grace), then ends the request as timed out.
    async with serving_tree(
        mode="aggregated", decode_workers=1, request_timeout=0.5, migration_limit=3
    ) as tree:
        outputs = open_request(
            _streams(tree),
            tree.serving.model().table,
            tree.serving.admission,
            _request("hung", 4000),
            timeout=0.5,
        )
        try:
            await outputs.__anext__()  # the first output: the stream actor owns the request
            assert outputs.owner is not None
            await hang(outputs.owner)
            pid = (await tree.engine_stats("decode-0")).pid
            os.kill(pid, signal.SIGKILL)  # the attempt fails; its actor will never answer
            with pytest.raises(RequestTimeout), anyio.fail_after(30):
                async for _ in outputs:
                    pass
        finally:
            outputs.close()


class _Streams(Actor):
    """A stand-in for the streams supervisor (it is only ever hung here)."""


async def test_a_hung_streams_supervisor_cannot_hold_a_new_request_past_its_deadline() -> None:
    # The first ask (start the stream actor, take the request) has the request's deadline too.
    spec = ChildSpec("streams", _Streams, shutdown=0.1)
    async with open_supervisor([spec], SupervisorFlags()) as root:
        streams = await root.child("streams")
        await hang(streams)
        admission = Admission()
        admission.enter()
        outputs = RequestOutputs(SupervisorRef(streams), _request("unstarted"), admission, 0.5)
        try:
            with pytest.raises(RequestTimeout), anyio.fail_after(30):
                await outputs.__anext__()
        finally:
            outputs.close()
        assert admission.inflight == 0
