"""Benchmark of KV transfer over NIXL between two processes, against the copy ceiling.

    python -m benchmarks.kv_transfer [--quick] [--bytes-per-token N] [--device auto|cpu|cuda]
                                     [--threads N] [--split-min-bytes N] [--no-baseline]

This process is the prefill worker (its pool on cpu or cuda:0); a decode worker runs in a child
process (``python -m actors.serving.kv._peer``, its pool on cpu or cuda:1). Every transfer goes
through the real path: decode allocates pages and sends the room's page list over the bootstrap
channel, prefill WRITEs its pages with one NIXL transfer (runs coalesced) and one notification,
decode receives the notification. The time measured is prefill's WRITE, from creating and posting
the NIXL transfer to NIXL's DONE, when the KV and the notification are at decode (the bootstrap
round trip before it and the handle's release after it are not counted; the release is shown
apart); the first transfer of every configuration is verified (per-page checksums), the timed
ones are not.

Request sizes 1, 16, 64 and 256 MiB of KV at ``--bytes-per-token`` (default 131072: Llama-3-8B
in bf16, 32 layers x 8 KV heads x 128 x 2 x 2 B), pages of 1, 16 and 64 tokens, in two layouts:

- ``contiguous``: the pages as the pool's allocator hands them out on a fresh pool (one run on
  each side, so one descriptor);
- ``scattered``: random pages of the pool on both sides (one descriptor per page: the worst case
  of a fragmented pool).

The prefill agent posts with ``--threads`` posting threads (default: ``KVConfig``'s, which on
CPU is ``min(4, cores // 4)``, none under 2, and ``ACTORSERVE_KV_THREADS`` overrides; none on
GPU): a WRITE of at least 2 x ``--split-min-bytes`` is cut into pieces, one chunk per thread
(the ``descs`` column counts the pieces). With threads, the 16-token contiguous rows are run
again without them (``thr`` 0; ``--no-baseline`` skips them), so the gain shows in one run.

The ceiling, in the same run and interleaved with the transfers (one copy after every timed
transfer, the same number of bytes): a single-threaded host memcpy (numpy) on CPU; on GPU a raw
torch copy from cuda:0 to cuda:1. A request moves whole pages, so a 1 MiB request of 16-token
pages moves one 2 MiB page: the table shows both, and rates count the bytes moved.

JSON keys: ``kv_gbps_<size>`` (contiguous, 16-token pages), ``ceiling_gbps_<size>``,
``ratio_<size>`` (and ``ratio_64MiB``), ``kv_gbps_64MiB_page16`` (scattered 16-token pages at
64 MiB), ``per_descriptor_us`` (the extra cost of one descriptor: scattered minus contiguous time
over the extra descriptors, 1-token pages at 64 MiB; with threads, both rows are split over
them), ``nixl_threads`` (the posting threads of every row above), ``split_min_bytes``,
``kv_gbps_<size>_threads0`` and ``ratio_<size>_threads0`` (the rows without threads, when
there are), ``device``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.serving.kv import KVConfig, KVPool, NixlAgent, PrefillKV, bootstrap_info
from actors.serving.kv import _transfer as transfer_mod
from actors.serving.kv._bootstrap import pack_pages
from actors.serving.kv._peer import PeerProcess, Receive, Stats

MiB = 1 << 20
SIZES_MIB = (1, 16, 64, 256)
PAGE_TOKENS = (1, 16, 64)
LAYOUTS = ("contiguous", "scattered")


def _iterations(size_mib: int, quick: bool) -> int:
    base = {1: 60, 16: 40, 64: 40, 256: 20}[size_mib]
    return max(3, base // 8) if quick else base


def _fill(pool: KVPool) -> None:
    """Non-trivial content (never time zeros), cheap to make."""
    host = pool.host_view
    if host is not None:
        words = host.reshape(-1).view(np.uint64)
        words[:] = np.arange(words.size, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        return
    import torch

    tensor = pool.tensor_view
    assert tensor is not None
    flat = tensor.reshape(-1).view(torch.int64)
    flat.copy_(torch.arange(flat.numel(), device=flat.device, dtype=torch.int64) * 7919 + 17)
    if flat.is_cuda:
        torch.cuda.synchronize(flat.device)


class _Ceiling:
    """The copy this transfer is compared with, timed right beside it (these hosts are shared):
    a single-threaded numpy memcpy on CPU, a torch copy from cuda:0 to cuda:1 on GPU."""

    def __init__(self, device: str, size: int) -> None:
        self.device = device
        if device == "cpu":
            self.src: Any = np.full(size, 7, dtype=np.uint8)
            self.dst: Any = np.ones(size, dtype=np.uint8)
        else:
            import torch

            self.src = torch.full((size,), 7, dtype=torch.uint8, device="cuda:0")
            self.dst = torch.ones(size, dtype=torch.uint8, device="cuda:1")

    def time(self, nbytes: int) -> float:
        if self.device == "cpu":
            t = time.perf_counter()
            np.copyto(self.dst[:nbytes], self.src[:nbytes])
            return time.perf_counter() - t
        import torch

        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
        t = time.perf_counter()
        self.dst[:nbytes].copy_(self.src[:nbytes], non_blocking=True)
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
        return time.perf_counter() - t


async def _one_transfer(
    kv: PrefillKV,
    proc: PeerProcess,
    local: np.ndarray[Any, Any],
    remote: np.ndarray[Any, Any],
    verify: bool,
) -> tuple[float, int]:
    room = kv.open_room()
    outcome: list[Any] = []
    with room:
        async with anyio.create_task_group() as tg:

            async def receive() -> None:
                cmd = Receive(
                    bootstrap=bootstrap_info(kv.endpoint, room.room),
                    num_pages=int(remote.size),
                    seed=0,
                    pages=pack_pages(remote),
                    verify=verify,
                    check_bytes=False,
                )
                outcome.append(await proc.call(cmd))

            tg.start_soon(receive)
            await room.wait_requested(30)
            result = await room.send(local)
    if not outcome[0].ok:
        raise RuntimeError(f"decode side failed: {outcome[0].code} {outcome[0].message}")
    return result.seconds, result.descriptors


async def _run_page_size(
    args: argparse.Namespace,
    device: str,
    page_tokens: int,
    ipc: str,
    rows: list[dict[str, Any]],
    passes: Sequence[tuple[int, Sequence[str]]],
) -> None:
    """Every size in every layout of ``passes`` (``(posting threads, layouts)``), each pass with
    a prefill agent of its own over the same pool and decode process."""
    page_bytes = page_tokens * args.bytes_per_token
    max_bytes = max(SIZES_MIB) * MiB
    num_pages = max(2, 2 * -(-max_bytes // page_bytes))
    local_device = "cpu" if device == "cpu" else "cuda:0"
    remote_device = "cpu" if device == "cpu" else "cuda:1"
    pool = KVPool.allocate(num_pages, page_bytes, device=local_device)  # before the agent: CUDA
    _fill(pool)
    ceiling = _Ceiling(device, max(SIZES_MIB) * MiB + page_bytes)
    async with PeerProcess.start(
        "decode",
        f"ipc://{ipc}/ctl-{page_tokens}",
        num_pages=num_pages,
        page_bytes=page_bytes,
        device=remote_device,
        heartbeat=0.5,
        peer_timeout=10.0,
        poll_while_pending=args.decode_spin,
    ) as proc:
        await proc.call(Stats(), timeout=120)
        for threads, layouts in passes:
            config = KVConfig(
                heartbeat_interval=0.5,
                peer_timeout=10.0,
                transfer_timeout=60.0,
                prepared_dlists=not args.raw_dlists,
                transfer_threads=threads,
                split_min_bytes=args.split_min_bytes,
            )
            with NixlAgent(prefix="bench-prefill", num_threads=threads) as agent:
                async with PrefillKV(agent, pool, config=config) as kv:
                    rows.extend(
                        [
                            await _measure(args, kv, proc, ceiling, size_mib, layout, threads)
                            for size_mib in SIZES_MIB
                            for layout in layouts
                        ]
                    )
                    stats = kv.statistics()
                    assert stats.rooms_failed == 0 and pool.statistics().pages_in_use == 0
            pool.close()  # deregistered with its agent: the next pass registers it again
    del pool, ceiling
    if device != "cpu":
        import torch

        torch.cuda.empty_cache()


async def _measure(
    args: argparse.Namespace,
    kv: PrefillKV,
    proc: PeerProcess,
    ceiling: _Ceiling,
    size_mib: int,
    layout: str,
    threads: int,
) -> dict[str, Any]:
    pool = kv.pool
    page_bytes = pool.page_bytes
    n = max(1, -(-size_mib * MiB // page_bytes))
    if layout == "contiguous":
        local = np.arange(n, dtype=np.int64)
        remote = np.arange(n, dtype=np.int64)
    else:
        rng = np.random.default_rng(size_mib * 1000 + page_bytes // 8192)
        local = rng.permutation(pool.num_pages)[:n].astype(np.int64)
        remote = rng.permutation(pool.num_pages)[:n].astype(np.int64)
    nbytes = n * page_bytes
    await _one_transfer(kv, proc, local, remote, verify=True)  # warm + verify
    ceiling.time(nbytes)
    times, copies = [], []
    descs = 0
    transfer_mod.PROFILE = []
    for _ in range(_iterations(size_mib, args.quick)):
        seconds, descs = await _one_transfer(kv, proc, local, remote, False)
        times.append(seconds)
        copies.append(ceiling.time(nbytes))
    med = statistics.median(times)
    gbps = nbytes / med / 1e9
    prof = transfer_mod.PROFILE or [(0.0, 0.0, 0.0, 0.0, 0)]
    transfer_mod.PROFILE = None
    make_us, post_us, poll_us, settle_us = (
        statistics.median(p[i] for p in prof) * 1e6 for i in range(4)
    )
    npolls = statistics.median(p[4] for p in prof)
    page_tokens = page_bytes // args.bytes_per_token
    print(
        f"# {size_mib} MiB page {page_tokens} tok {layout} {threads} threads: {n} pages,"
        f" {descs} descs, {med * 1e3:.3f} ms, {gbps:.1f} GB/s; create {make_us:.0f} us,"
        f" post {post_us:.0f} us, poll {poll_us:.0f} us ({npolls:g} polls),"
        f" release {settle_us:.0f} us",
        file=sys.stderr,
        flush=True,
    )
    return {
        "size_mib": size_mib,
        "page_tokens": page_tokens,
        "page_bytes": page_bytes,
        "layout": layout,
        "threads": threads,
        "pages": n,
        "descriptors": descs,
        "nbytes": nbytes,
        "seconds": med,
        "gbps": gbps,
        "ceiling_gbps": nbytes / statistics.median(copies) / 1e9,
    }


def _pick_device(requested: str) -> str:
    if requested != "auto":
        return requested
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "cpu"


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    device = _pick_device(args.device)
    rows: list[dict[str, Any]] = []
    ipc = tempfile.mkdtemp(prefix="kvb-", dir="/tmp")
    threads = args.threads
    if threads is None:
        threads = KVConfig().agent_threads("DRAM" if device == "cpu" else "VRAM")
    for page_tokens in PAGE_TOKENS:
        passes: list[tuple[int, Sequence[str]]] = [(threads, LAYOUTS)]
        if page_tokens == 16 and threads and not args.no_baseline:
            passes.append((0, ("contiguous",)))  # the same rows without posting threads
        await _run_page_size(args, device, page_tokens, ipc, rows, passes)
    if device == "cpu":
        name = f"cpu ({os.cpu_count()} cores)"
    else:
        import torch

        name = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"

    def row(size: int, tokens: int, layout: str, nthreads: int = threads) -> dict[str, Any]:
        return next(
            r
            for r in rows
            if r["size_mib"] == size
            and r["page_tokens"] == tokens
            and r["layout"] == layout
            and r["threads"] == nthreads
        )

    console = Console(width=150)
    spin = ", decode spins while pending" if args.decode_spin else ""
    spin += ", raw descriptor lists" if args.raw_dlists else ""
    table = Table(
        title=f"KV transfer over NIXL ({name}, {args.bytes_per_token} B/token, {threads} posting"
        f" threads, split from {args.split_min_bytes / MiB:g} MiB per thread{spin})"
    )
    for col in ("KV", "moved", "page", "layout", "thr", "pages", "descs", "ms", "GB/s"):
        table.add_column(col, justify="right")
    for col in ("copy GB/s", "ratio"):
        table.add_column(col, justify="right")
    for r in rows:
        ceil = r["ceiling_gbps"]
        table.add_row(
            f"{r['size_mib']} MiB",
            f"{r['nbytes'] / MiB:g} MiB",
            f"{r['page_tokens']} tok",
            r["layout"],
            str(r["threads"]),
            str(r["pages"]),
            str(r["descriptors"]),
            f"{r['seconds'] * 1e3:.3f}",
            f"{r['gbps']:.1f}",
            f"{ceil:.1f}",
            f"{r['gbps'] / ceil:.2f}",
        )
    console.print(table)

    result: dict[str, Any] = {}
    for size in SIZES_MIB:
        main_row = row(size, 16, "contiguous")
        result[f"kv_gbps_{size}MiB"] = round(main_row["gbps"], 2)
        result[f"ceiling_gbps_{size}MiB"] = round(main_row["ceiling_gbps"], 2)
        result[f"ratio_{size}MiB"] = round(main_row["gbps"] / main_row["ceiling_gbps"], 3)
    result["kv_gbps_64MiB_page16"] = round(row(64, 16, "scattered")["gbps"], 2)
    scat, cont = row(64, 1, "scattered"), row(64, 1, "contiguous")
    extra = max(1, scat["descriptors"] - cont["descriptors"])
    result["per_descriptor_us"] = round((scat["seconds"] - cont["seconds"]) / extra * 1e6, 3)
    if any(r["threads"] != threads for r in rows):
        for size in SIZES_MIB:
            base = row(size, 16, "contiguous", 0)
            result[f"kv_gbps_{size}MiB_threads0"] = round(base["gbps"], 2)
            result[f"ratio_{size}MiB_threads0"] = round(base["gbps"] / base["ceiling_gbps"], 3)
    result["nixl_threads"] = threads
    result["split_min_bytes"] = args.split_min_bytes
    result["device"] = name
    result["bytes_per_token"] = args.bytes_per_token
    result["decode_spin"] = args.decode_spin
    result["prepared_dlists"] = not args.raw_dlists
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (< 60 s on CPU)")
    parser.add_argument("--bytes-per-token", type=int, default=131072)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    parser.add_argument(
        "--raw-dlists",
        action="store_true",
        help="build every WRITE from raw descriptor lists (KVConfig.prepared_dlists=False)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="the prefill agent's posting threads (default: KVConfig's, by memory and cores)",
    )
    parser.add_argument(
        "--split-min-bytes",
        type=int,
        default=KVConfig().split_min_bytes,
        help="split a WRITE only in chunks of at least this many bytes per thread",
    )
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the rows without posting threads (16-token pages, contiguous)",
    )
    parser.add_argument(
        "--decode-spin",
        action="store_true",
        help="decode polls NIXL hard while a room is pending (KVConfig.poll_while_pending)",
    )
    args = parser.parse_args()
    if args.bytes_per_token <= 0 or args.bytes_per_token % 8:
        parser.error("--bytes-per-token must be a positive multiple of 8")
    if args.threads is not None and args.threads < 0:
        parser.error("--threads must be >= 0")
    if args.split_min_bytes <= 0:
        parser.error("--split-min-bytes must be positive")
    start = time.perf_counter()
    result = anyio.run(_main, args, backend=args.backend)
    result["wall_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
