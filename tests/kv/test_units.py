"""KV transfer building blocks without peer processes: pool, coalescing, checksums, wire."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import anyio
import msgspec
import numpy as np
import numpy.typing as npt
import pytest
import torch

from actors.serving.kv import (
    Descriptors,
    KVConfig,
    KVPool,
    KVPoolExhausted,
    NixlAgent,
    _transfer,
    bootstrap_endpoint,
    bootstrap_info,
    checksums_of,
    coalesce,
    page_checksums,
)
from actors.serving.kv._alloc import runs
from actors.serving.kv._bootstrap import THREADS_ENV
from actors.serving.kv._nixl import SPLIT_BATCH, XferHandle, XferState
from actors.serving.kv._peer import pattern_pages
from actors.serving.kv._transfer import split, split_pieces, write_pages, yield_cpu
from protocols.kv import (
    Hello,
    KVMemoryDesc,
    TransferNotification,
    TransferRequest,
    Writing,
    decode_message,
    decode_notification,
    decode_notifications,
    encode_message,
    encode_notification,
    encode_notifications,
)


def test_pool_allocates_contiguous_runs_best_fit_and_accounts() -> None:
    pool = KVPool.allocate(64, 64, device="cpu")
    a = pool.alloc(10)
    b = pool.alloc(10)
    c = pool.alloc(10)
    assert a.pages.tolist() == list(range(10)) and b.pages[0] == 10
    b.free()
    small = pool.alloc(4)  # best fit: the 10-page hole, not the 34-page tail
    assert small.pages.tolist() == [10, 11, 12, 13]
    stats = pool.statistics()
    assert stats.pages_in_use == 24 and stats.allocations_live == 3
    assert stats.largest_free_run == 34
    for alloc in (a, c, small):
        alloc.free()
        alloc.free()  # idempotent
    stats = pool.statistics()
    assert stats.pages_in_use == 0 and stats.allocations_live == 0
    assert stats.largest_free_run == 64


def test_on_free_runs_once_when_the_pages_are_freed() -> None:
    pool = KVPool.allocate(8, 64, device="cpu")
    calls: list[str] = []
    held = pool.alloc(2)
    held.on_free(lambda: calls.append("held"))
    assert calls == []
    held.free()
    held.free()
    freed = pool.alloc(1)
    freed.free()
    freed.on_free(lambda: calls.append("freed"))  # already free: at once
    assert calls == ["held", "freed"] and pool.statistics().pages_in_use == 0


def test_pool_fragmented_allocation_uses_fewest_runs_and_exhaustion_is_typed() -> None:
    pool = KVPool.allocate(16, 64, device="cpu")
    held = [pool.alloc_exact([i]) for i in (2, 5, 6, 11)]
    big = pool.alloc(10)  # no free run of 10: the largest runs first
    assert len(big) == 10 and len(set(big.pages.tolist())) == 10
    assert not set(big.pages.tolist()) & {2, 5, 6, 11}
    with pytest.raises(KVPoolExhausted):
        pool.alloc(3)
    with pytest.raises(KVPoolExhausted):
        pool.alloc_exact([2])  # taken
    assert KVPoolExhausted.code == "capacity.kv_pool_exhausted"
    big.free()
    for alloc in held:
        alloc.free()
    assert pool.statistics().pages_free == 16


def test_runs_of_pages_in_any_order() -> None:
    def pages(*ids: int) -> npt.NDArray[np.int64]:
        return np.array(ids, dtype=np.int64)

    assert runs(pages()) == []
    assert runs(pages(7)) == [(7, 1)]
    assert runs(pages(3, 4, 5, 6)) == [(3, 4)]
    assert runs(pages(3, 4, 9, 10, 11, 2)) == [(3, 2), (9, 3), (2, 1)]  # in the given order
    assert runs(pages(5, 4, 3)) == [(5, 1), (4, 1), (3, 1)]  # consecutive means ascending
    assert runs(pages(1, 1, 2)) == [(1, 1), (1, 2)]  # a duplicate starts a run (claimed twice)
    pool = KVPool.allocate(16, 8, device="cpu")
    held = pool.alloc_exact([9, 3, 4, 10, 5])
    with pytest.raises(KVPoolExhausted):
        pool.alloc_exact([1, 5])
    with pytest.raises(ValueError, match="out of range"):
        pool.alloc_exact([2, 16])
    held.free()
    with pytest.raises(ValueError, match="out of range"):
        pool.alloc_exact([14, 15, 16])  # one ascending run, past the end
    held = pool.alloc_exact((12, 13, 0, 1))  # runs out of order: kept in the given order
    assert held.pages.tolist() == [12, 13, 0, 1] and pool.statistics().pages_in_use == 4
    with pytest.raises(KVPoolExhausted):
        pool.alloc_exact(np.array([1, 2]))
    held.free()
    assert pool.statistics().pages_in_use == 0 and len(pool.alloc_exact([1, 5])) == 2


def test_pool_adopts_numpy_torch_and_raw_buffers() -> None:
    array = np.zeros((8, 128), dtype=np.float32)
    pool = KVPool.from_buffer(array, page_bytes=512)
    assert pool.num_pages == 8 and pool.mem_type == "DRAM"
    assert pool.base_addr == array.ctypes.data
    host = pool.host_view
    assert host is not None
    host[3, :4] = 0xFF
    assert array.view(np.uint8).reshape(8, 512)[3, 0] == 0xFF  # the engine's memory itself

    tensor = torch.zeros(4096, dtype=torch.bfloat16)
    tpool = KVPool.from_buffer(tensor, page_bytes=1024)
    assert tpool.num_pages == 8 and tpool.base_addr == tensor.data_ptr()

    raw = KVPool.from_address(array.ctypes.data, array.nbytes, 512, keepalive=array)
    assert np.array_equal(page_checksums(raw, np.arange(8)), page_checksums(pool, np.arange(8)))
    with pytest.raises(ValueError):
        KVPool.from_buffer(np.zeros((8, 8))[:, ::2], page_bytes=64)


def test_coalesce_merges_runs_consecutive_on_both_sides() -> None:
    local = KVMemoryDesc(mem_type="DRAM", device_id=0, base_addr=1000, num_pages=64, page_bytes=8)
    remote = KVMemoryDesc(mem_type="VRAM", device_id=1, base_addr=5000, num_pages=64, page_bytes=8)
    descs = coalesce(np.arange(10, 20), local, np.arange(30, 40), remote)
    assert descs.count == 1 and descs.nbytes == 80
    assert descs.local.tolist() == [[1080, 80, 0]] and descs.remote.tolist() == [[5240, 80, 1]]
    # Runs break where either side breaks.
    lp = np.array([0, 1, 2, 3, 7, 8, 9])
    rp = np.array([5, 6, 9, 10, 11, 12, 13])
    descs = coalesce(lp, local, rp, remote)
    assert descs.local[:, 1].tolist() == [16, 16, 24]
    assert descs.remote[:, 0].tolist() == [5040, 5072, 5088]
    with pytest.raises(ValueError):
        coalesce(np.arange(3), local, np.arange(4), remote)
    with pytest.raises(ValueError):
        coalesce(np.array([64]), local, np.array([0]), remote)


def test_split_cuts_runs_into_near_equal_aligned_pieces_that_cover_them() -> None:
    page = 1 << 20
    local = KVMemoryDesc(
        mem_type="DRAM", device_id=0, base_addr=1 << 30, num_pages=64, page_bytes=page
    )
    remote = KVMemoryDesc(
        mem_type="DRAM", device_id=0, base_addr=1 << 34, num_pages=64, page_bytes=page
    )

    def pieces_cover(whole: Descriptors, cut: Descriptors) -> None:
        assert int(cut.local[:, 1].sum()) == whole.nbytes == cut.nbytes
        assert np.array_equal(cut.local[:, 1], cut.remote[:, 1])
        assert not (cut.local[:, :2] % 4096).any() and not (cut.remote[:, 1] % 4096).any()
        # In order: each run's pieces follow each other on both sides, and end where it ends.
        ends = set(
            zip(
                whole.local[:, 0] + whole.local[:, 1],
                whole.remote[:, 0] + whole.remote[:, 1],
                strict=True,
            )
        )
        for (la, ln, _), (ra, _, _), nxt_l, nxt_r in zip(
            cut.local[:-1], cut.remote[:-1], cut.local[1:, 0], cut.remote[1:, 0], strict=True
        ):
            assert (la + ln == nxt_l and ra + ln == nxt_r) or (la + ln, ra + ln) in ends

    one = coalesce(np.arange(10), local, np.arange(20, 30), remote)
    cut = split(one, 16)
    pieces_cover(one, cut)
    assert cut.count == 16 and cut.local[:, 1].max() - cut.local[:, 1].min() <= 4096
    lp = np.array([0, 1, 2, 3, 4, 5, 6, 7, 40, 50])  # runs of 8, 1 and 1 pages
    mixed = coalesce(lp, local, np.arange(10), remote)
    cut = split(mixed, 16)
    pieces_cover(mixed, cut)
    assert cut.count == 16 and cut.local[:, 1].max() <= 1.1 * mixed.nbytes / 16  # longest cut
    assert split(mixed, 3) is mixed  # runs enough already: NIXL cuts by count
    tiny = KVMemoryDesc(mem_type="DRAM", device_id=0, base_addr=0, num_pages=8, page_bytes=4096)
    small = coalesce(np.arange(2), tiny, np.arange(2), tiny)
    assert split(small, 8).count == 2  # never below 4 KiB a piece
    assert split_pieces(16 << 20, 4, 1 << 20) == 4 * SPLIT_BATCH
    assert split_pieces(3 << 20, 4, 1 << 20) == 3 * SPLIT_BATCH
    assert split_pieces(1 << 20, 4, 1 << 20) == 0  # one chunk: not worth a thread hop
    assert split_pieces(64 << 20, 0, 1 << 20) == split_pieces(64 << 20, 1, 1 << 20) == 0


def test_posting_threads_by_memory_cores_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(THREADS_ENV, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert KVConfig().agent_threads("DRAM") == 4 and KVConfig().agent_threads("VRAM") == 0
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert KVConfig().agent_threads("DRAM") == 0  # one thread would only add a hop
    monkeypatch.setenv(THREADS_ENV, "3")
    assert KVConfig().agent_threads("DRAM") == 3 and KVConfig().agent_threads("VRAM") == 0
    assert KVConfig(transfer_threads=2).agent_threads("VRAM") == 2  # explicit: any memory
    monkeypatch.setenv(THREADS_ENV, "many")
    with pytest.raises(ValueError, match=THREADS_ENV):
        KVConfig().agent_threads("DRAM")
    with pytest.raises(ValueError):
        KVConfig(transfer_threads=-1)
    with pytest.raises(ValueError):
        NixlAgent(num_threads=-1)


def _thread_cpu_s(tids: set[str]) -> float:
    total = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / os.sysconf("SC_CLK_TCK")


def test_posting_threads_split_a_write_and_sleep_when_idle() -> None:
    before = set(os.listdir("/proc/self/task"))
    src = np.arange(8 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    with NixlAgent(prefix="sender", num_threads=4) as a, NixlAgent(prefix="target") as b:
        threads = set(os.listdir("/proc/self/task")) - before
        assert len(threads) >= 4 and a.statistics().num_threads == 4
        a.register(int(src.ctypes.data), src.nbytes, "DRAM", 0)
        b.register(int(dst.ctypes.data), dst.nbytes, "DRAM", 0)
        a.add_remote(b.metadata(), b.name)
        b.add_remote(a.metadata(), a.name)
        whole = Descriptors(
            local=np.array([[src.ctypes.data, src.nbytes, 0]], dtype=np.uint64),
            remote=np.array([[dst.ctypes.data, dst.nbytes, 0]], dtype=np.uint64),
            nbytes=src.nbytes,
        )
        descs = split(whole, 4 * SPLIT_BATCH)
        handle, state = a.post("WRITE", descs.local, "DRAM", descs.remote, "DRAM", b.name, b"done")
        notifs: list[bytes] = []
        for _ in range(100_000):
            if state != "PROC" and notifs:
                break
            state = a.state(handle) if state == "PROC" else state
            notifs += b.get_notifs().get(a.name, [])
        assert state == "DONE" and notifs == [b"done"] and np.array_equal(src, dst)
        assert a.release(handle)
        # Idle now: the posting threads block, they do not poll.
        used = _thread_cpu_s(threads)
        time.sleep(0.5)
        assert _thread_cpu_s(threads) - used < 0.1
    assert a.statistics().xfers_live == 0


def test_spinning_pollers_yield_the_cpu_once_per_round_between_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(_transfer, "time", SimpleNamespace(sleep=slept.append))
    monkeypatch.setattr(_transfer._Spin, "polls", 0)
    monkeypatch.setattr(_transfer._Spin, "spinners", 0)
    yield_cpu()  # a lone poller (decode's notification poller): every poll yields
    yield_cpu()
    assert slept == [0, 0]
    monkeypatch.setattr(_transfer._Spin, "spinners", 4)  # a drain's WRITEs spinning together
    for _ in range(12):  # three rounds of the four
        yield_cpu()
    assert slept == [0] * 5


async def test_concurrent_writes_register_their_spinning_and_leave_none_behind() -> None:
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros_like(src)
    with NixlAgent(prefix="sender") as a, NixlAgent(prefix="target") as b:
        a.register(int(src.ctypes.data), src.nbytes, "DRAM", 0)
        b.register(int(dst.ctypes.data), dst.nbytes, "DRAM", 0)
        a.add_remote(b.metadata(), b.name)
        b.add_remote(a.metadata(), a.name)
        piece = src.nbytes // 8

        def post(i: int) -> tuple[XferHandle, XferState]:
            lo = np.array([[src.ctypes.data + i * piece, piece, 0]], dtype=np.uint64)
            hi = np.array([[dst.ctypes.data + i * piece, piece, 0]], dtype=np.uint64)
            return a.post("WRITE", lo, "DRAM", hi, "DRAM", b.name, b"%d" % i)

        async def one(i: int) -> None:
            await write_pages(a, lambda: post(i), b.name, timeout=10, yields=True)

        async def progress_target(done: anyio.Event) -> None:
            while not done.is_set():
                b.get_notifs()
                await anyio.sleep(0.001)

        done = anyio.Event()
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(progress_target, done)
                async with anyio.create_task_group() as writes:
                    for i in range(8):
                        writes.start_soon(one, i)
                done.set()
            # One cancelled while it spins: its count goes too.
            with anyio.move_on_after(0):
                await write_pages(a, lambda: post(0), b.name, timeout=10, yields=True)
        assert _transfer._Spin.spinners == 0
        assert np.array_equal(src, dst)
    assert a.statistics().xfers_live == 0


def test_checksums_agree_across_numpy_and_torch_and_catch_flips_and_swaps() -> None:
    pages = pattern_pages(seed=9, count=6, page_bytes=256)
    want = checksums_of(pages)
    assert np.array_equal(want, checksums_of(torch.from_numpy(pages.copy())))
    from actors.serving.kv._checksum import _torch_checksums

    assert np.array_equal(want, _torch_checksums(torch.from_numpy(pages.copy())))
    flipped = pages.copy()
    flipped[2, 100] ^= 0x01
    assert (checksums_of(flipped) != want).tolist() == [False, False, True, False, False, False]
    swapped = pages.copy()
    words = swapped.view(np.uint64)
    words[4, [0, 1]] = words[4, [1, 0]]
    assert checksums_of(swapped)[4] != want[4]


def test_wire_messages_round_trip_and_reject_garbage() -> None:
    mem = KVMemoryDesc(mem_type="DRAM", device_id=0, base_addr=1, num_pages=2, page_bytes=8)
    hello = Hello(
        worker_id="d", agent_name="a", incarnation=7, agent_metadata=b"\x00md", memory=mem
    )
    assert decode_message(encode_message(hello)) == hello
    req = TransferRequest(room=(1 << 63) - 1, pages=b"\x01" * 16)
    assert decode_message(encode_message(req)) == req
    notif = TransferNotification(room=5, checksums=b"\x02" * 8)
    assert decode_notification(encode_notification(notif)) == notif
    # A WRITE shared by several rooms names each; one room's reads as a list of one.
    shared = [notif, TransferNotification(room=6, aux=b"\x03")]
    assert decode_notifications(encode_notifications(shared)) == shared
    assert decode_notifications(encode_notification(notif)) == [notif]
    writing = Writing(room=5, more=[6, 7])
    assert decode_message(encode_message(writing)) == writing
    with pytest.raises(msgspec.ValidationError):
        decode_message(encode_notification(notif))
    with pytest.raises(msgspec.DecodeError):
        decode_message(b"\xc1")


def test_bootstrap_triples_for_tcp_and_ipc() -> None:
    info = bootstrap_info("tcp://127.0.0.1:5757", 42)
    assert (info.host, info.port, info.room) == ("127.0.0.1", 5757, 42)
    assert bootstrap_endpoint(info) == "tcp://127.0.0.1:5757"
    ipc = bootstrap_info("ipc:///tmp/x.sock", 1)
    assert bootstrap_endpoint(ipc) == "ipc:///tmp/x.sock" and ipc.port == 0


def test_agent_replaces_a_stale_remote_agent_of_the_same_name_and_releases_all() -> None:
    with NixlAgent(prefix="a") as a:
        buf = np.zeros(4096, dtype=np.uint8)
        reg = a.register(int(buf.ctypes.data), buf.nbytes, "DRAM", 0)
        for life in range(2):  # the peer "restarts" under the same name
            with NixlAgent("peer-same-name") as b:
                assert a.add_remote(b.metadata(), "peer-same-name") == "peer-same-name"
                assert a.statistics().remote_agents == 1
                assert a.statistics().remote_agents_replaced == life
        stats = a.statistics()
        assert stats.registrations == 1 and stats.registered_bytes == 4096
        a.deregister(reg)
    assert a.statistics().registrations == 0 and a.statistics().remote_agents == 0


def test_a_tensor_held_pool_takes_the_gpu_code_paths_and_agrees() -> None:
    # The GPU pool's code (views, gathers, checksums through torch) run on a CPU tensor.
    from actors.serving.kv._peer import fill_pattern, read_pages

    tensor = torch.zeros(16 * 256, dtype=torch.uint8)
    pool = KVPool(
        page_bytes=256,
        nbytes=tensor.numel(),
        base_addr=tensor.data_ptr(),
        mem_type="DRAM",
        device_id=0,
        host=None,
        tensor=tensor,
    )
    assert pool.host_view is None and pool.tensor_view is not None
    pages = np.array([9, 3, 4, 12], dtype=np.int64)
    fill_pattern(pool, pages, seed=5)
    want = pattern_pages(5, 4, 256)
    assert np.array_equal(read_pages(pool, pages), want)
    assert np.array_equal(page_checksums(pool, pages), checksums_of(want))
