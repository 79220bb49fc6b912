"""The mock engine's real memory: release/resume (measured), page content, and the KV-transfer
hook between a prefill and a decode engine."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from actors.serving.engines import MockEngine, MockEngineBusy, page_checksum
from actors.serving.engines._mock._kvmem import KvPageMemory
from actors.testing import wait_until
from protocols.engine import BootstrapInfo, MemoryTag, PauseMode
from protocols.errors import KVCorrupted, KVTransferError
from protocols.pages import prompt_page_hashes
from tests.engines._mock_helpers import (
    DEVICE,
    collect,
    config,
    memory_in_use,
    request,
    run,
    tokens_of,
)

MIB = 1024 * 1024
PROMPT = list(range(500, 540))  # 2 full pages of 16 and a partial one
BOOT = BootstrapInfo(host="127.0.0.1", port=7100, room=42)


async def test_release_and_resume_really_free_and_restore_memory() -> None:
    cfg = config(num_blocks=256, kv_bytes_per_block=256 * 1024, weights_bytes=64 * MIB)
    async with MockEngine(cfg) as engine:
        expected, _ = await run(engine, request("a", PROMPT, max_tokens=20))
        before = memory_in_use()
        await engine.release_memory([MemoryTag.KV_CACHE, MemoryTag.WEIGHTS])
        released = memory_in_use()
        assert before - released >= 0.75 * 128 * MIB
        assert engine.released_tags == {MemoryTag.KV_CACHE, MemoryTag.WEIGHTS}
        # Released twice, or resuming what was never released: no-ops.
        await engine.release_memory([MemoryTag.KV_CACHE])
        await engine.resume_memory([MemoryTag.CUDA_GRAPH])
        # Requests wait while the memory is away...
        stream = engine.generate(request("b", PROMPT, max_tokens=20))
        await anyio.sleep(0.02)
        assert engine.phase_of("b") == "waiting"
        await engine.resume_memory([MemoryTag.KV_CACHE])
        await anyio.sleep(0.02)
        assert engine.phase_of("b") == "waiting"  # the weights are still away
        await engine.resume_memory([MemoryTag.WEIGHTS])
        assert memory_in_use() - released >= 0.75 * 128 * MIB
        assert engine.released_tags == frozenset()
        # ... and run with the same result after the resume (the prefix cache is gone).
        tokens = tokens_of(await collect(stream))
        assert tokens == expected
        assert engine.kv_memory().generation == 2


async def test_kv_release_refused_while_requests_hold_kv() -> None:
    async with MockEngine(config()) as engine:
        stream = engine.generate(request("a", PROMPT, max_tokens=10_000))
        await stream.__anext__()
        await engine.pause(PauseMode.IN_PLACE)
        with pytest.raises(MockEngineBusy):
            await engine.release_memory([MemoryTag.KV_CACHE])
        await engine.release_memory([MemoryTag.CUDA_GRAPH])  # other tags are fine
        await engine.resume_memory([MemoryTag.CUDA_GRAPH])
        await stream.aclose()
        await engine.continue_generation()


async def test_pages_hold_their_deterministic_content() -> None:
    async with MockEngine(config()) as engine:
        await run(engine, request("a", PROMPT, max_tokens=30))  # 70 tokens: 4 full pages
        info = engine.kv_memory()
        assert info.device == DEVICE and info.size == 64 * 256 and info.address != 0
        buffer = engine.kv_buffer()
        assert tuple(buffer.shape) == (64, 256)
        if DEVICE == "cpu":
            assert buffer.dtype == np.uint8
            assert buffer.__array_interface__["data"][0] == info.address
        else:
            assert buffer.data_ptr() == info.address and buffer.is_cuda
        hashes = engine.cached_block_hashes()
        assert prompt_page_hashes(PROMPT, 16, partial=False)[0] in hashes
        # Blocks are handed out from 0: block 0 holds the prompt's first page.
        first = prompt_page_hashes(PROMPT, 16)[0]
        assert engine.verify_block(0, first)
        assert engine.block_checksum(0) == page_checksum(first, 256)
        assert not engine.verify_block(1, first)
        buffer[0, 7] ^= 0xFF
        assert not engine.verify_block(0, first)


def test_tensor_pages_are_written_and_verified_in_one_pass() -> None:
    """The device path of the page memory (a torch tensor, here on the CPU unless the tests
    run with ``cuda``): many pages written and verified at once, as on the host."""
    torch = pytest.importorskip("torch")
    host = KvPageMemory(0, 16, 256, "cpu")
    tensor = KvPageMemory(0, 16, 256, DEVICE)
    host.allocate()
    tensor.allocate()
    if DEVICE == "cpu":
        # The tensor stand-in for device memory: what HostOrDeviceBuffer holds on a GPU.
        assert tensor._buf is not None
        tensor._buf.host, tensor._pages = None, None
        tensor._buf.tensor = torch.zeros(16 * 256, dtype=torch.uint8)
        tensor.warm_device()  # what allocate() does on a GPU: it leaves every byte as it was
    assert not tensor.buffer().any()
    hashes = prompt_page_hashes(list(range(100)), 16)  # 7 pages, the last one partial
    blocks = [9, 2, 15, 4, 0, 11, 6]
    for memory in (host, tensor):
        memory.write_pages(blocks, hashes)
        assert memory.bad_pages(blocks, hashes) == []
    assert np.array_equal(tensor.buffer().cpu().numpy(), host.buffer())
    tensor.buffer()[blocks[3], 5] ^= 1
    tensor.buffer()[blocks[6], 255] ^= 1
    assert tensor.bad_pages(blocks, hashes) == [3, 6]
    assert tensor.bad_pages(blocks[:3], hashes[:3]) == []
    tensor._scratch_tensors = None  # the page check's scratch, grown as a larger check needs it
    assert tensor.bad_pages(blocks[:2], hashes[:2]) == []
    assert tensor.bad_pages(blocks, hashes) == [3, 6]
    assert not tensor.verify(blocks[3], hashes[3]) and tensor.verify(blocks[4], hashes[4])
    host.write(blocks[1], hashes[2])  # a whole page of another's content: every row consistent
    host.buffer()[blocks[5], 0] ^= 1  # the first row alone
    assert host.bad_pages(blocks, hashes) == [1, 5]
    host.free()
    tensor.free()


async def _disaggregated(
    prefill: MockEngine, decode: MockEngine, rid: str, *, corrupt: bool = False
) -> list[int]:
    req = request(rid, PROMPT, max_tokens=25, bootstrap=BOOT)
    stream = decode.generate(req)
    target = await decode.wait_transfer_target(rid)
    outputs = await collect(prefill.generate(req))
    assert len(tokens_of(outputs)) == 1
    assert outputs[-1].disaggregated_params == BOOT
    source = await prefill.wait_transfer_source(rid)
    assert not prefill.is_quiescent()  # the KV is owed
    assert len(source.block_ids) == len(target.block_ids) == 3 and source.num_tokens == 40
    src, dst = prefill.kv_buffer(source.dp_rank), decode.kv_buffer(target.dp_rank)
    for s, d in zip(source.block_ids, target.block_ids, strict=True):
        dst[d] = src[s]  # what a NIXL WRITE does
    if corrupt:
        dst[target.block_ids[2], 3] ^= 1
    assert decode.verify_pages(target.block_ids, PROMPT) == ([2] if corrupt else [])
    verified = decode.complete_transfer(rid)
    assert verified is not corrupt
    async with anyio.create_task_group() as tg:
        tg.start_soon(prefill.wait_quiescent)  # a drain waits for the owed KV
        await anyio.sleep(0.01)
        prefill.release_transfer(rid)
    assert prefill.is_quiescent()
    return tokens_of(await collect(stream))


async def test_prefill_to_decode_transfer_continues_exactly() -> None:
    async with (
        MockEngine(config()) as agg,
        MockEngine(config(role="prefill", bootstrap_port=7100)) as prefill,
        MockEngine(config(role="decode")) as decode,
    ):
        assert prefill.capacity.bootstrap == BootstrapInfo(host="127.0.0.1", port=7100, room=0)
        expected, _ = await run(agg, request("ref", PROMPT, max_tokens=25))
        assert await _disaggregated(prefill, decode, "x") == expected
        # The received pages entered decode's prefix cache.
        full = prompt_page_hashes(PROMPT, 16, partial=False)
        assert set(full) <= decode.cached_block_hashes()
        assert decode.is_quiescent() and decode.statistics().used_blocks == 0


async def test_corrupted_pages_fail_the_request_with_kv_corrupted() -> None:
    async with (
        MockEngine(config(role="prefill")) as prefill,
        MockEngine(config(role="decode")) as decode,
    ):
        with pytest.raises(KVCorrupted):
            await _disaggregated(prefill, decode, "x", corrupt=True)
        assert KVCorrupted.migratable
        assert decode.statistics().used_blocks == 0 and decode.cached_block_hashes() == set()


async def test_failed_and_timed_out_transfers() -> None:
    async with (
        MockEngine(config(role="prefill", transfer_timeout_s=0.05)) as prefill,
        MockEngine(config(role="decode", transfer_timeout_s=0.05)) as decode,
    ):
        stream = decode.generate(request("f", PROMPT, bootstrap=BOOT))
        await decode.wait_transfer_target("f")
        decode.fail_transfer("f", "nixl: remote disconnect")
        with pytest.raises(KVTransferError, match="remote disconnect"):
            await collect(stream)
        # Nobody writes the pages: decode gives up after the timeout.
        stream = decode.generate(request("t", PROMPT, bootstrap=BOOT))
        with pytest.raises(KVTransferError):
            await collect(stream)
        # Nobody takes the pages: prefill releases them after the timeout.
        await collect(prefill.generate(request("p", PROMPT, bootstrap=BOOT)))
        assert prefill.statistics().ranks[0].owed == 1
        await wait_until(prefill.is_quiescent, timeout=5.0)
        assert prefill.statistics().used_blocks == 0
        assert decode.statistics().used_blocks == 0


async def test_abort_while_awaiting_or_owing_kv() -> None:
    async with (
        MockEngine(config(role="prefill")) as prefill,
        MockEngine(config(role="decode")) as decode,
    ):
        stream = decode.generate(request("d", PROMPT, bootstrap=BOOT))
        await decode.wait_transfer_target("d")
        assert decode.phase_of("d") == "awaiting_kv"
        await decode.abort("d")
        outputs = await collect(stream)
        assert outputs[-1].finish_reason == "cancelled"
        with pytest.raises(KVTransferError):
            decode.complete_transfer("d")
        await collect(prefill.generate(request("p", PROMPT, bootstrap=BOOT)))
        assert prefill.phase_of("p") == "owed"
        await prefill.abort("p")
        assert prefill.is_quiescent() and prefill.statistics().used_blocks == 0
        with pytest.raises(KVTransferError):
            await prefill.wait_transfer_source("p")
        assert decode.statistics().used_blocks == 0


async def test_fake_bootstrap_host_runs_without_a_transfer() -> None:
    fake = BootstrapInfo(host="2.2.2.2", port=1, room=0)
    async with MockEngine(config(role="decode")) as decode, MockEngine(config()) as agg:
        tokens, _ = await run(decode, request("a", PROMPT, max_tokens=5, bootstrap=fake))
        expected, _ = await run(agg, request("b", PROMPT, max_tokens=5))
        assert tokens == expected
