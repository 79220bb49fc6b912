"""The kernel's cross-process copy against memcpy: the floor under NIXL's CPU transfers.

    python -m benchmarks.cma_ceiling [--quick]

On one host, UCX moves a NIXL WRITE between DRAM pools with its ``cma`` transport (run
``UCX_PROTO_INFO=y python -m benchmarks.kv_transfer --quick --device cpu`` to see it chosen):
one ``process_vm_writev`` per run of pages, a copy the kernel makes in the calling thread. This
script measures that system call alone (no NIXL, no UCX) into another process's memory, beside a
single-threaded memcpy of the same bytes, best of N each, and the same copy split over 2 and 4
threads. It tells how much of the gap in ``kv_transfer.py``'s CPU ratio is the transport itself.

JSON keys: ``cma_gbps_<size>``, ``memcpy_gbps_<size>``, ``ratio_<size>`` (cma / memcpy),
``cma2_gbps_<size>`` and ``cma4_gbps_<size>`` (threads), ``cpus``.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import signal
import threading
import time
from typing import Any

import numpy as np

from benchmarks._common import report

_libc = ctypes.CDLL(None, use_errno=True)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _writev(pid: int, src: int, dst: int, size: int) -> None:
    local, remote = _IoVec(src, size), _IoVec(dst, size)
    done = _libc.process_vm_writev(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if done != size:
        raise OSError(ctypes.get_errno(), "process_vm_writev failed")


def _split(pid: int, src: int, dst: int, size: int, threads: int) -> None:
    part = size // threads
    workers = [
        threading.Thread(target=_writev, args=(pid, src + k * part, dst + k * part, part))
        for k in range(threads)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def _best(fn: Any, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(mib: int, reps: int) -> dict[str, float]:
    size = mib << 20
    target = mmap.mmap(-1, size)  # shared with the child by fork, written there first
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the target process: own every page (copy-on-write broken), then wait
        np.frombuffer(target, dtype=np.uint8)[::4096] = 1
        os.write(ready_w, b"r")
        time.sleep(3600)
        os._exit(0)
    try:
        os.read(ready_r, 1)
        dst = ctypes.addressof(ctypes.c_char.from_buffer(target))
        src_array = np.ones(size, dtype=np.uint8)
        local = np.zeros(size, dtype=np.uint8)
        src = src_array.ctypes.data
        gb = size / 1e9
        cma = gb / _best(lambda: _writev(pid, src, dst, size), reps)
        memcpy = gb / _best(lambda: np.copyto(local, src_array), reps)
        cma2 = gb / _best(lambda: _split(pid, src, dst, size, 2), reps)
        cma4 = gb / _best(lambda: _split(pid, src, dst, size, 4), reps)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(ready_r)
        os.close(ready_w)
    return {"cma": cma, "memcpy": memcpy, "cma2": cma2, "cma4": cma4}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (under 10 s)")
    args = parser.parse_args()
    reps = 5 if args.quick else 20
    rows: list[tuple[str, object, str]] = []
    result: dict[str, Any] = {}
    for mib in (1, 16, 64, 256):
        m = measure(mib, reps)
        ratio = m["cma"] / m["memcpy"]
        rows.append(
            (
                f"{mib} MiB",
                f"{m['cma']:.2f} GB/s",
                f"memcpy {m['memcpy']:.2f}, ratio {ratio:.2f}; "
                f"2 threads {m['cma2']:.2f}, 4 threads {m['cma4']:.2f}",
            )
        )
        result |= {
            f"cma_gbps_{mib}MiB": round(m["cma"], 2),
            f"memcpy_gbps_{mib}MiB": round(m["memcpy"], 2),
            f"ratio_{mib}MiB": round(ratio, 3),
            f"cma2_gbps_{mib}MiB": round(m["cma2"], 2),
            f"cma4_gbps_{mib}MiB": round(m["cma4"], 2),
        }
    result["cpus"] = os.cpu_count()
    report("process_vm_writev (UCX cma) vs memcpy, best of N", rows, result)


if __name__ == "__main__":
    main()
