"""Live migration's engine halves: a draining engine hands its decoding requests over at a step
boundary, and the receiving engine starts the ones that arrive together in one step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import msgspec
import pytest

from actors.serving.engines import KvPages, MockEngine, TimingModel
from actors.serving.kv import PageAllocation, ReceivedKV
from actors.serving.worker import replay_kv_events
from actors.serving.worker._faults import InjectedFaults
from actors.serving.worker._kvbridge import MockTransfer, _pack_prefix_hash
from actors.testing import wait_until
from protocols.engine import BootstrapInfo, EngineOutput, PreprocessedRequest, StopConditions
from protocols.errors import KVCorrupted
from protocols.kv_events import BlockStored
from tests.engines._mock_helpers import collect, config, request, run, tokens_of

PROMPTS = [list(range(500 + i, 540 + i)) for i in range(3)]  # 2 full pages of 16 and a partial


def _live(rid: str, prompt: list[int], done: list[int], max_tokens: int) -> PreprocessedRequest:
    """The request that continues after ``done`` tokens from handed-over KV (as a request
    stream makes it: the newest token is recomputed by the new engine, hence ``done[:-1]``)."""
    boot = BootstrapInfo(host="127.0.0.1", port=7100, room=len(done))
    req = request(rid, [*prompt, *done[:-1]], max_tokens=max_tokens - len(done) + 1, bootstrap=boot)
    return msgspec.structs.replace(req, live_migration=True)


async def _deliver(source: MockEngine, pages: KvPages | None, target: MockEngine, rid: str) -> None:
    """Copy handed-over ``pages`` into the pages ``target`` allocated for request ``rid``."""
    assert pages is not None
    target_pages = await target.wait_transfer_target(rid)
    src, dst = source.kv_buffer(pages.dp_rank), target.kv_buffer(target_pages.dp_rank)
    for s, d in zip(pages.block_ids, target_pages.block_ids, strict=True):
        dst[d] = src[s]  # what the NIXL WRITE does


async def _until_token(stream: Any) -> list[EngineOutput]:
    """Outputs up to and including the first with a token."""
    out: list[EngineOutput] = []
    async for output in stream:
        out.append(output)
        if output.token_ids:
            break
    return out


async def test_hand_over_lets_the_step_in_flight_deliver_its_tokens() -> None:
    timed = TimingModel(speedup=20.0)  # a step is always in flight while requests decode
    async with (
        MockEngine(config(timing=timed, record_steps=True)) as source,
        MockEngine(config()) as reference,
        MockEngine(config(role="decode")) as target,
    ):
        streams = [
            source.generate(request(f"r{i}", p, max_tokens=40)) for i, p in enumerate(PROMPTS)
        ]
        done = [tokens_of(await _until_token(s)) for s in streams]
        waiting = source.generate(request("w", PROMPTS[0], max_tokens=40))  # not decoding yet
        steps = len(source.step_records())
        pages = await source.hand_over(["r0", "r1", "r2", "w", "gone"])
        # The step in flight was committed with every request in it; none started since.
        records = source.step_records()
        assert len(records) == steps + 1 and records[-1].decode_requests == 3
        assert pages.keys() == {"r0", "r1", "r2", "w"} and pages["w"] is None
        for i, stream in enumerate(streams):
            outputs = await collect(stream)
            assert outputs[-1].finish_reason == "cancelled"
            done[i] += tokens_of(outputs)
            kv = pages[f"r{i}"]
            assert kv is not None and kv.num_tokens == len(PROMPTS[i]) + len(done[i]) - 1
        assert not source.is_quiescent()  # the KV is owed until the transfer took it
        await waiting.aclose()
        # The next engine continues each request exactly from its handed-over KV.
        for i, prompt in enumerate(PROMPTS):
            expected, _ = await run(reference, request(f"ref{i}", prompt, max_tokens=40))
            live = _live(f"m{i}", prompt, done[i], 40)
            stream = target.generate(live)
            kv = pages[f"r{i}"]
            await _deliver(source, kv, target, live.rid)
            # It starts from the hash the pages came with (no hashing of the context first);
            # the check in its first step finds it is its tokens' (else: KVCorrupted).
            assert kv is not None and kv.prefix_hash is not None
            assert target.complete_transfer(live.rid, overlap=True, prefix_hash=kv.prefix_hash)
            source.release_transfer(f"r{i}")
            rest = tokens_of(await collect(stream))
            assert rest[0] == done[i][-1]  # the newest token, recomputed
            assert [*done[i], *rest[1:]] == expected
        assert target.statistics().ranks[0].prefill_tokens == 0
        assert source.is_quiescent() and source.statistics().used_blocks == 0


async def test_a_drain_offers_the_kv_while_the_step_in_flight_runs() -> None:
    timed = TimingModel(speedup=0.2)  # steps of tens of ms, always one in flight
    async with MockEngine(config(timing=timed, record_steps=True)) as source:
        # r0 and r1 decode on; r2 has one token left, which the step in flight produces.
        streams = [
            source.generate(request(f"r{i}", p, max_tokens=2 if i == 2 else 40))
            for i, p in enumerate(PROMPTS)
        ]
        done = [tokens_of(await _until_token(s)) for s in streams]
        planned: dict[str, int] = {}

        def offer(covered: dict[str, int]) -> dict[str, BootstrapInfo]:
            planned.update(covered)
            return {
                rid: BootstrapInfo(host="127.0.0.1", port=7100, room=i)
                for i, rid in enumerate(covered)
            }

        steps = len(source.step_records())
        pages: dict[str, KvPages | None] = {}
        async with anyio.create_task_group() as tg:

            async def hand_over() -> None:
                pages.update(await source.hand_over(["r0", "r1", "r2"], offer))

            tg.start_soon(hand_over)
            offers = [await s.__anext__() for s in streams]
            # Each stream has its offer before the step in flight ended: how far its KV will
            # go (every token but the one that step samples) and where.
            assert len(source.step_records()) == steps
        assert planned == {f"r{i}": len(p) + len(done[i]) for i, p in enumerate(PROMPTS)}
        for i, out in enumerate(offers):
            assert out.token_ids == [] and out.finish_reason is None
            assert out.disaggregated_params == BootstrapInfo(host="127.0.0.1", port=7100, room=i)
            assert out.handover_tokens == planned[f"r{i}"]
        # r2 ended at that boundary: not handed over (its stream ends as it would have).
        assert pages.keys() == {"r0", "r1"}
        rest = [await collect(s) for s in streams]
        assert [r[-1].finish_reason for r in rest] == ["cancelled", "cancelled", "length"]
        for i in range(2):
            kv = pages[f"r{i}"]
            assert kv is not None and kv.num_tokens == planned[f"r{i}"]
            assert len(PROMPTS[i]) + len(done[i]) + len(tokens_of(rest[i])) == kv.num_tokens + 1
            source.release_transfer(f"r{i}")
        assert source.is_quiescent() and source.statistics().used_blocks == 0


async def _handed_over(source: MockEngine) -> tuple[dict[str, KvPages | None], list[list[int]]]:
    streams = [source.generate(request(f"r{i}", p, max_tokens=30)) for i, p in enumerate(PROMPTS)]
    done = [tokens_of(await _until_token(s)) for s in streams]
    pages = await source.hand_over([f"r{i}" for i in range(len(PROMPTS))])
    for i, stream in enumerate(streams):
        done[i] += tokens_of(await collect(stream))
    return pages, done


@pytest.mark.parametrize("late_s", [0.01, 1.0], ids=["soon", "after-a-lone-step"])
async def test_live_migrations_arriving_together_start_in_one_step(late_s: float) -> None:
    # Steps of ~0.8 s for the first context alone, ~1.3 s for the three: the first arrival is
    # held back (as long as the step they then all take) while the others' KV is still on its
    # way, instead of starting a step of its own; even 1 s later they start with it.
    slow = TimingModel(speedup=0.01)
    async with (
        MockEngine(config()) as source,
        MockEngine(config(role="decode", timing=slow, record_steps=True)) as target,
    ):
        pages, done = await _handed_over(source)
        lives = [_live(f"m{i}", p, done[i], 30) for i, p in enumerate(PROMPTS)]
        streams = [target.generate(live) for live in lives]
        for i, live in enumerate(lives):
            await _deliver(source, pages[f"r{i}"], target, live.rid)
        assert target.complete_transfer("m0")
        await anyio.sleep(late_s)  # the scheduler sees the first one alone
        for live in lives[1:]:
            assert target.complete_transfer(live.rid)
            await anyio.sleep(0.01)
        for i, stream in enumerate(streams):
            # The newest token again, held back until the first new one is there too.
            again = tokens_of(await _until_token(stream))
            assert again[0] == done[i][-1] and len(again) == 2
        assert [r.decode_requests for r in target.step_records()[:1]] == [3]
        for i, stream in enumerate(streams):
            await stream.aclose()
            source.release_transfer(f"r{i}")


async def test_a_live_migration_whose_peers_never_arrive_still_starts() -> None:
    async with (
        MockEngine(config()) as source,
        MockEngine(config(role="decode", timing=TimingModel(speedup=5.0))) as target,
    ):
        pages, done = await _handed_over(source)
        first, late = _live("m0", PROMPTS[0], done[0], 30), _live("m1", PROMPTS[1], done[1], 30)
        stream, late_stream = target.generate(first), target.generate(late)
        await _deliver(source, pages["r0"], target, first.rid)
        await target.wait_transfer_target(late.rid)  # its KV never comes
        assert target.complete_transfer(first.rid)
        with anyio.fail_after(10):
            # The newest token again, with what decoding produced after it.
            again = tokens_of(await _until_token(stream))
            assert again[0] == done[0][-1] and len(again) >= 2
        await late_stream.aclose()
        await stream.aclose()
        for rid in ("r0", "r1", "r2"):
            source.release_transfer(rid)
        assert target.is_quiescent() and source.is_quiescent()


async def test_live_migrations_received_together_publish_one_kv_event_batch() -> None:
    async with (
        MockEngine(config()) as source,
        MockEngine(config(role="decode", timing=TimingModel(speedup=0.01))) as target,
    ):
        pages, done = await _handed_over(source)
        lives = [_live(f"m{i}", p, done[i], 30) for i, p in enumerate(PROMPTS)]
        streams = [target.generate(live) for live in lives]
        for i, live in enumerate(lives):
            await _deliver(source, pages[f"r{i}"], target, live.rid)
        last = target.kv_events_last_seq()
        for i, live in enumerate(lives):  # their KV arrived in one turn
            assert target.complete_transfer(live.rid)
            source.release_transfer(f"r{i}")
        # Their pages are published by the step loop's next turn, all in one batch.
        assert target.kv_events_last_seq() == last
        await wait_until(lambda: target.kv_events_last_seq() > last, timeout=5.0)
        replay = target.capacity.kv_events_replay_endpoints[0]
        (seq, batch), *_ = await replay_kv_events(replay, last + 1)
        stored = {h for e in batch.events if isinstance(e, BlockStored) for h in e.block_hashes}
        assert seq == last + 1 and stored == target.cached_block_hashes()
        assert len(stored) == sum(len(live.token_ids) // 16 for live in lives)
        for stream in streams:
            await stream.aclose()


@pytest.mark.parametrize("overlap", [False, True], ids=["checked", "overlapped"])
@pytest.mark.parametrize("prepared", [True, False], ids=["prepared", "unprepared"])
async def test_contexts_completed_together_are_verified_each_on_its_own(
    prepared: bool, overlap: bool
) -> None:
    async with (
        MockEngine(config()) as source,
        MockEngine(config(role="decode")) as target,
    ):
        pages, done = await _handed_over(source)
        lives = [_live(f"m{i}", p, done[i], 30) for i, p in enumerate(PROMPTS)]
        if prepared:
            # As a prefill's KV (not a live migration's, which comes with its hash): the step
            # loop's turn while the transfer is in flight works out what each context's KV
            # must hold; without it the arrival (or the check in the step) does.
            lives = [msgspec.structs.replace(live, live_migration=False) for live in lives]
        streams = [target.generate(live) for live in lives]
        if prepared:
            await anyio.sleep(0.01)
            assert all(target._find(live.rid).expected is not None for live in lives)
        for i, live in enumerate(lives):
            await _deliver(source, pages[f"r{i}"], target, live.rid)
        dst = target.kv_buffer(0)
        m1 = await target.wait_transfer_target("m1")
        dst[m1.block_ids[1], 100] ^= 1  # one flipped byte inside a page of the second context
        m2 = await target.wait_transfer_target("m2")
        dst[m2.block_ids[-1]] = 0  # the third context's last page never arrived
        # One pass over every page of the three; a request that is not waiting is left out.
        # Overlapped, all three start and the pass runs while their first step does: the
        # failing ones end before any token of it.
        verified = target.complete_transfers(["m0", "m1", "m2", "gone"], overlap=overlap)
        assert verified == {"m0": True, "m1": overlap, "m2": overlap}
        again = tokens_of(await _until_token(streams[0]))
        assert again[0] == done[0][-1]  # m0 decodes on
        for stream, kv, page in ((streams[1], m1, 1), (streams[2], m2, len(m2.block_ids) - 1)):
            pattern = f"1 of {len(kv.block_ids)} KV pages failed verification .first: page {page}"
            with pytest.raises(KVCorrupted, match=pattern):
                await collect(stream)
        for i, stream in enumerate(streams):
            await stream.aclose()
            source.release_transfer(f"r{i}")
        assert target.is_quiescent() and source.is_quiescent()


async def test_an_overlapped_check_runs_with_the_first_step() -> None:
    slow = TimingModel(speedup=0.1)  # steps of ~60 ms: the check is seen to wait for one
    async with (
        MockEngine(config()) as source,
        MockEngine(config(role="decode", timing=slow)) as target,
    ):
        pages, done = await _handed_over(source)
        lives = [_live(f"m{i}", p, done[i], 30) for i, p in enumerate(PROMPTS)]
        # m2 may produce only the token it recomputes: it ends at once, so it is checked first.
        lives[2] = msgspec.structs.replace(lives[2], stop_conditions=StopConditions(max_tokens=1))
        streams = [target.generate(live) for live in lives]
        for i, live in enumerate(lives):
            await _deliver(source, pages[f"r{i}"], target, live.rid)
        m2 = await target.wait_transfer_target("m2")
        target.kv_buffer(0)[m2.block_ids[0], 7] ^= 1
        before = target.cached_block_hashes()
        verified = target.complete_transfers(["m0", "m1", "m2"], overlap=True)
        assert verified == {"m0": True, "m1": True, "m2": False}
        assert target.cached_block_hashes() == before  # nothing checked, nothing registered
        await target.abort("m1")  # before its check: never checked, its blocks freed
        again = tokens_of(await _until_token(streams[0]))
        assert again[0] == done[0][-1] and len(again) == 2
        registered = target.cached_block_hashes() - before
        assert len(registered) == len(lives[0].token_ids) // 16  # m0's full pages, checked
        assert (await collect(streams[1]))[-1].finish_reason == "cancelled"
        with pytest.raises(KVCorrupted):
            await collect(streams[2])
        for i, stream in enumerate(streams):
            await stream.aclose()
            source.release_transfer(f"r{i}")
        assert target.is_quiescent() and source.is_quiescent()


@pytest.mark.parametrize("overlap", [False, True], ids=["checked", "overlapped"])
async def test_kv_whose_hash_is_not_its_tokens_fails(overlap: bool) -> None:
    # Timed steps: overlapped, the check (and m1's end) falls inside a step in flight.
    timed = TimingModel(speedup=20.0)
    async with (
        MockEngine(config()) as source,
        MockEngine(config(role="decode", timing=timed)) as target,
    ):
        pages, done = await _handed_over(source)
        lives = [_live(f"m{i}", p, done[i], 30) for i, p in enumerate(PROMPTS)]
        streams = [target.generate(live) for live in lives]
        for i, live in enumerate(lives):
            await _deliver(source, pages[f"r{i}"], target, live.rid)
        kv0, kv1 = pages["r0"], pages["r1"]
        assert kv0 is not None and kv1 is not None and kv0.prefix_hash != kv1.prefix_hash
        # m1's pages are intact, but the hash that came with them is m0's: another sequence.
        hashes = {"m0": kv0.prefix_hash, "m1": kv0.prefix_hash}
        verified = target.complete_transfers(["m0", "m1"], overlap=overlap, prefix_hashes=hashes)
        assert verified == {"m0": True, "m1": overlap}
        assert tokens_of(await _until_token(streams[0]))[0] == done[0][-1]
        with pytest.raises(KVCorrupted, match="another sequence"):
            await collect(streams[1])
        for i, stream in enumerate(streams):
            await stream.aclose()
            source.release_transfer(f"r{i}")
        assert target.is_quiescent() and source.is_quiescent()


async def test_the_bridge_verifies_the_kv_landing_in_one_turn_in_one_pass() -> None:
    faults = InjectedFaults()
    faults.add("corrupt_kv")  # the first request to check gets a flipped byte

    async with (
        MockEngine(config()) as source,
        MockEngine(config(role="decode")) as target,
    ):
        transfer = MockTransfer(target, faults)
        pool = transfer.pool()
        pages, done = await _handed_over(source)
        lives = [_live(f"m{i}", p, done[i], 30) for i, p in enumerate(PROMPTS)]
        passes: list[list[str]] = []
        complete = target.complete_transfers

        def counted(
            rids: Sequence[str], *, overlap: bool = False, prefix_hashes: Any = None
        ) -> dict[str, bool]:
            # The bridge checks the pages while their first step runs, and starts each from
            # the hash its KV came with.
            assert overlap and prefix_hashes is not None and prefix_hashes.keys() == set(rids)
            passes.append(sorted(rids))
            return complete(rids, overlap=overlap, prefix_hashes=prefix_hashes)

        target.complete_transfers = counted  # type: ignore[method-assign]
        landed = anyio.Event()
        waiting: list[str] = []
        first: dict[str, int | None] = {}

        async def migrate(i: int, live: PreprocessedRequest) -> None:
            async def receive(alloc: PageAllocation, verify: bool) -> ReceivedKV:
                waiting.append(live.rid)
                if len(waiting) == len(lives):
                    landed.set()
                await landed.wait()  # every room's KV lands in the same turn
                kv = pages[f"r{i}"]
                await _deliver(source, kv, target, live.rid)
                assert kv is not None
                aux = _pack_prefix_hash(kv.prefix_hash)  # as the source's room sends it
                return ReceivedKV(
                    room=i, pages=alloc, checksums=None, verified=False, seconds=0, aux=aux
                )

            outputs = transfer.decode(live, receive)
            try:
                async for output in outputs:
                    if output.token_ids:
                        first[live.rid] = output.token_ids[0]
                        break
            except KVCorrupted:
                first[live.rid] = None
            finally:
                await outputs.aclose()

        async with anyio.create_task_group() as tg:
            for i, live in enumerate(lives):
                tg.start_soon(migrate, i, live)
        assert passes == [["m0", "m1", "m2"]]
        # The corrupted one fails alone; the others go on from the newest token.
        assert list(first.values()).count(None) == 1
        for i, live in enumerate(lives):
            assert first[live.rid] in (None, done[i][-1])
            source.release_transfer(f"r{i}")
        pool.close()
        assert target.is_quiescent() and source.is_quiescent()
