"""A request's start: its request stream is started with the request in its mailbox and routes
from the routing view itself. A consumer that gives up before the stream took the request still
ends it (its :class:`~actors.serving._attempt.Ticket`), and the in-flight counts the router keeps
come back to zero however requests end."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest

from actors import ReplyError, current_registry
from actors.frontend import ModelInfo
from actors.serving import ModelService
from actors.serving._attempt import Begin, Ticket
from protocols import PreprocessedRequest, SamplingOptions, StopConditions
from supervisors import SupervisorRef
from tests.helpers.serving import Tree, serving_tree
from tests.serving.test_disaggregated import DISAGG, _quiet
from tests.serving.test_e2e import _stream_text


def _streams(tree: Tree) -> SupervisorRef:
    ref = current_registry().whereis(tree.serving.streams_name)
    assert ref is not None
    return SupervisorRef(ref)


def _service(tree: Tree) -> ModelService:
    model = ModelInfo("mock", 4096, tree.serving.tokenizer)
    return ModelService(model, _streams(tree), tree.serving.table)


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
        while any(w.active for w in tree.serving.table.workers.values()):
            await anyio.sleep(0.01)
    await _quiet(tree)


async def test_a_stream_whose_consumer_gave_up_before_it_ran_ends_at_once() -> None:
    async with serving_tree(mode="aggregated", decode_workers=1) as tree:
        ticket = Ticket()
        ticket.closed = True  # what a consumer's close() leaves before the stream has run
        with pytest.raises(ReplyError):
            await _streams(tree).start_dynamic_ask(Begin(_request("gone"), ticket))
        assert ticket.ref is not None  # it took the request, saw the ticket closed, ended
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
