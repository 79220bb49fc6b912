"""Real KV page memory whose content is a deterministic function of the tokens.

One contiguous buffer per data-parallel rank, ``num_blocks * block_bytes`` bytes: host memory from
an anonymous ``mmap`` (so a release really returns the pages to the OS and the RSS drops), or a
torch CUDA tensor when a GPU is present. Block ``b`` lives at byte offset ``b * block_bytes``.

A page is named by its chained hash (:func:`protocols.pages.page_hash`), which stands for the
whole prefix up to the page's end; its content is derived from that hash alone: 64-byte rows, row
``r`` word ``k`` = ``mix(hash + (k+1)*G) XOR mix(r*G + 1)`` (``mix``: splitmix64's finaliser, ``G``
the golden ratio constant), cheap to write and to verify for many pages at once (a few numpy
passes). The trailing partial page of a prompt uses the hash of its partial tokens, so a transfer of
a whole prompt can be verified page by page.
"""

from __future__ import annotations

import importlib
import mmap
import os
import sys
from collections.abc import Sequence
from typing import Any, Literal

import msgspec
import numpy as np
import numpy.typing as npt

from actors.serving.engines._mock._tokens import U64Array, mix64, mix_in_place

__all__ = [
    "HostOrDeviceBuffer",
    "KvMemoryInfo",
    "KvPageMemory",
    "page_checksum",
    "page_content",
    "resolve_device",
]

_ROW_WORDS = 8  # 64-byte rows
_NVIDIA_PATHS = (
    "/proc/driver/nvidia/version",
    "/dev/nvidia0",
    "/dev/nvidiactl",
    "/usr/local/nvidia",
)
_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
_LANES = np.arange(1, _ROW_WORDS + 1, dtype=np.uint64) * np.uint64(_GOLDEN)  # word k: (k+1)*G
# The device page check's scratch, made up front (a drain of 16 4k contexts of 1 KiB pages: 1 MiB).
_WARM_SCRATCH_BYTES = 8 << 20


def _row_words(block_bytes: int) -> U64Array:
    rows = block_bytes // 64
    return np.array([mix64(r * _GOLDEN + 1) for r in range(rows)], dtype=np.uint64)


def _base_words(hashes: Sequence[int] | npt.NDArray[np.int64]) -> U64Array:
    """``(n, 8)``: the words every row of page ``i`` XORs with its row mask, for all the pages
    at once (a received context is verified, a prefill chunk written, in a few numpy passes)."""
    words = np.array(hashes, dtype=np.int64).view(np.uint64)[:, None] + _LANES
    return mix_in_place(words)


def page_content(hash_: int, block_bytes: int) -> npt.NDArray[np.uint8]:
    """The exact bytes a page with chained hash ``hash_`` holds."""
    words: U64Array = _base_words([hash_]) ^ _row_words(block_bytes)[:, None]
    return words.reshape(-1).view(np.uint8)


def page_checksum(hash_: int, block_bytes: int) -> int:
    """A cheap checksum of a page's expected content: the sum of its 64-bit words mod 2**64."""
    return int(page_content(hash_, block_bytes).view(np.uint64).sum(dtype=np.uint64))


def resolve_device(device: Literal["auto", "cpu", "cuda"]) -> str:
    """``cpu`` or ``cuda``; ``auto`` imports torch only where an NVIDIA driver is present."""
    if device != "auto":
        return device
    # Importing torch costs seconds: only where a driver (or torch itself) is already in sight.
    if "torch" not in sys.modules and not any(map(os.path.exists, _NVIDIA_PATHS)):
        return "cpu"
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        return "cpu"
    return "cuda" if bool(torch.cuda.is_available()) else "cpu"


class KvMemoryInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Where one rank's KV pages live, for registering them with a transfer agent (NIXL).

    ``generation`` grows with every re-allocation (resume after release): registrations made for
    an older generation point at freed memory.
    """

    dp_rank: int
    device: str  # "cpu" (NIXL "DRAM") or "cuda" (NIXL "VRAM")
    device_id: int
    address: int
    size: int
    num_blocks: int
    block_bytes: int
    generation: int

    def block_offset(self, block_id: int) -> int:
        """Byte offset of ``block_id`` within the buffer."""
        return block_id * self.block_bytes


class HostOrDeviceBuffer:
    """A contiguous byte buffer on the host (``mmap``) or a CUDA device (torch)."""

    def __init__(self, size: int, device: str) -> None:
        self.size = size
        self.device = device
        self._mmap: mmap.mmap | None = None
        self.host: npt.NDArray[np.uint8] | None = None
        self.tensor: Any = None  # torch.Tensor on CUDA; typed Any to keep torch out of mypy
        self.address = 0
        if device == "cuda":
            torch = importlib.import_module("torch")
            self.tensor = torch.zeros(size, dtype=torch.uint8, device="cuda")
            self.address = int(self.tensor.data_ptr())
        else:
            self._mmap = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.host = np.frombuffer(self._mmap, dtype=np.uint8, count=size)
            # Touch every page now, as a GPU allocation commits its memory at once.
            self.host.fill(0)
            self.address = int(self.host.__array_interface__["data"][0]) if size else 0

    def fill_pattern(self, seed: int) -> None:
        """Write a deterministic pattern everywhere (the weights stand-in's "load")."""
        words = self.size // 8
        if self.host is not None:
            view = self.host[: words * 8].view(np.uint64)
            view[:] = np.arange(words, dtype=np.uint64)
            view ^= np.uint64(mix64(seed))
        elif self.tensor is not None:
            self.tensor.fill_(seed & 0xFF)

    def free(self) -> None:
        """Return the memory to the OS (or the CUDA allocator) now."""
        self.host = None
        if self._mmap is not None:
            # MADV_DONTNEED drops the pages even if a caller still holds a view (a later read of
            # such a stale view sees zeros, never freed memory); then unmap when no view remains.
            if self.size:
                self._mmap.madvise(mmap.MADV_DONTNEED)
            try:
                self._mmap.close()
            except BufferError:
                pass
            self._mmap = None
        if self.tensor is not None:
            self.tensor = None
            torch = importlib.import_module("torch")
            torch.cuda.empty_cache()
        self.address = 0


class KvPageMemory:
    """One rank's KV pages: allocate, free, write a page's content, verify, checksum."""

    def __init__(self, dp_rank: int, num_blocks: int, block_bytes: int, device: str) -> None:
        self.dp_rank = dp_rank
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.device = device
        self.generation = 0
        self._buf: HostOrDeviceBuffer | None = None
        self._rows = _row_words(block_bytes)
        # Row r's mask repeated over its 8 words: contiguous, so a page is XORed with it in one
        # pass (a stride-0 broadcast made the same XOR ~1.5x slower).
        self._row_tile = np.ascontiguousarray(
            np.broadcast_to(self._rows[:, None], (self._rows.size, _ROW_WORDS))
        )
        self._pages: U64Array | None = None  # (num_blocks, rows, 8) view of host memory
        # The gather's output, reused: a fresh one per verification is a fresh large allocation
        # (mmap'd), whose every page faults on first touch, for every drain's batch. On a device:
        # the gathered blocks there, and their host copy (pinned, as a CUDA copy wants it).
        self._scratch: U64Array = np.empty((0, self._rows.size, _ROW_WORDS), dtype=np.uint64)
        self._scratch_tensors: tuple[Any, Any] | None = None  # (device, host) torch tensors

    @property
    def allocated(self) -> bool:
        return self._buf is not None

    def allocate(self) -> None:
        if self._buf is not None:
            return
        self._buf = HostOrDeviceBuffer(self.num_blocks * self.block_bytes, self.device)
        self.generation += 1
        if self._buf.host is not None:
            rows = self.block_bytes // 64
            self._pages = self._buf.host.view(np.uint64).reshape(self.num_blocks, rows, _ROW_WORDS)
        else:
            self.warm_device()

    def warm_device(self) -> None:
        """Launch the page gather and scatter once, block 0 written back as it is: CUDA loads
        a kernel at its first launch, which the first live migration's page check would
        otherwise pay for on the receiving engine's event loop."""
        blocks = self.buffer()
        torch = importlib.import_module("torch")
        # The scratch too (pinned host memory is slow to allocate), sized for a drain's batch.
        self._device_scratch(min(self.num_blocks, max(1, _WARM_SCRATCH_BYTES // self.block_bytes)))
        self._gather(np.zeros(1, dtype=np.int64))
        index = torch.zeros(1, dtype=torch.int64, device=blocks.device)
        blocks.index_copy_(0, index, blocks.index_select(0, index))

    def free(self) -> None:
        self._pages = None
        self._scratch = self._scratch[:0].copy()
        self._scratch_tensors = None
        if self._buf is not None:
            self._buf.free()
            self._buf = None

    def info(self) -> KvMemoryInfo:
        buf = self._require()
        return KvMemoryInfo(
            dp_rank=self.dp_rank,
            device=self.device,
            device_id=int(buf.tensor.device.index or 0) if buf.tensor is not None else 0,
            address=buf.address,
            size=buf.size,
            num_blocks=self.num_blocks,
            block_bytes=self.block_bytes,
            generation=self.generation,
        )

    def buffer(self) -> Any:
        """The whole buffer: a ``(num_blocks, block_bytes)`` uint8 numpy array or CUDA tensor."""
        buf = self._require()
        if buf.host is not None:
            return buf.host.reshape(self.num_blocks, self.block_bytes)
        return buf.tensor.view(self.num_blocks, self.block_bytes)

    def _require(self) -> HostOrDeviceBuffer:
        if self._buf is None:
            raise RuntimeError(f"KV memory of rank {self.dp_rank} is released")
        return self._buf

    def _expected(self, hashes: Sequence[int]) -> U64Array:
        """``(n, rows, 8)``: the content of the pages ``hashes``."""
        return _base_words(hashes)[:, None, :] ^ self._row_tile

    def write(self, block_id: int, hash_: int) -> None:
        """Fill ``block_id`` with the content of the page whose chained hash is ``hash_``."""
        self.write_pages([block_id], [hash_])

    def write_pages(self, block_ids: Sequence[int], hashes: Sequence[int]) -> None:
        """:meth:`write` for many pages at once: ``block_ids[i]`` gets page ``hashes[i]``."""
        if not block_ids:
            return
        expected = self._expected(hashes)
        if self._pages is not None:
            self._pages[list(block_ids)] = expected
            return
        # On a device: one host-to-device copy and one scatter for all the pages.
        blocks = self.buffer()
        torch = importlib.import_module("torch")
        pages = torch.from_numpy(expected.reshape(len(hashes), -1).view(np.uint8))
        index = torch.tensor(list(block_ids), dtype=torch.int64, device=blocks.device)
        blocks.index_copy_(0, index, pages.to(blocks.device))

    def read(self, block_id: int) -> npt.NDArray[np.uint8]:
        """A host copy of one block's bytes."""
        out = np.empty(self.block_bytes, dtype=np.uint8)
        if self._pages is not None:
            out[:] = self._pages[block_id].reshape(-1).view(np.uint8)
            return out
        buf = self._require()
        start = block_id * self.block_bytes
        out[:] = buf.tensor[start : start + self.block_bytes].cpu().numpy()
        return out

    def verify(self, block_id: int, hash_: int) -> bool:
        """True when ``block_id`` holds exactly the content of page ``hash_``."""
        if self._pages is not None:
            return bool(np.array_equal(self._pages[block_id], self._expected([hash_])[0]))
        return bool(np.array_equal(self.read(block_id), page_content(hash_, self.block_bytes)))

    def bad_pages(
        self,
        block_ids: Sequence[int] | npt.NDArray[np.int64],
        hashes: Sequence[int] | npt.NDArray[np.int64],
    ) -> list[int]:
        """Indices ``i`` whose block ``block_ids[i]`` does not hold the page ``hashes[i]``.

        One vectorised comparison for all the pages, whatever their number (on a device, after
        one gather there and one copy back, not a synchronising copy per page): a live migration
        verifies every context that arrived together (64 pages per 4k tokens) in one pass on the
        receiving engine's event loop."""
        n = len(hashes)
        if not n:
            return []
        base = _base_words(hashes)[:, None, :]
        got = self._gather(np.array(block_ids[:n], dtype=np.int64))  # a copy: XORed in place
        # Zero where a page holds its expected content. Few numpy calls on the path where all
        # pages verify: each costs far more than its bytes on a busy engine's event loop.
        got ^= self._row_tile
        got ^= base
        if not got.any():
            return []
        return [int(i) for i in np.flatnonzero(got.reshape(n, -1).any(axis=1))]

    def _gather(self, block_ids: npt.NDArray[np.int64]) -> U64Array:
        """A host copy of the blocks ``block_ids``, ``(n, rows, 8)``: valid until the next
        call (it is the reused scratch)."""
        n = block_ids.size
        if self._pages is not None:
            if self._scratch.shape[0] < n:
                size = max(n, 2 * self._scratch.shape[0])
                self._scratch = np.empty((size, *self._scratch.shape[1:]), dtype=np.uint64)
            out = self._scratch[:n]
            # "clip": with ``out``, numpy's default ("raise") copies through a temporary. The
            # ids are the engine's own blocks; one out of range would read the first or last
            # block, which fails the verification, never passes it.
            return self._pages.take(block_ids, axis=0, out=out, mode="clip")
        blocks = self.buffer()
        torch = importlib.import_module("torch")
        scratch = self._device_scratch(n)
        index = torch.from_numpy(block_ids).to(blocks.device)
        on_device, host = scratch[0][:n], scratch[1][:n]
        torch.index_select(blocks, 0, index, out=on_device)
        host.copy_(on_device)  # synchronous: the host copy is complete on return
        pages: npt.NDArray[np.uint8] = host.numpy()
        return pages.view(np.uint64).reshape(n, self._rows.size, _ROW_WORDS)

    def _device_scratch(self, n: int) -> tuple[Any, Any]:
        """The gather's scratch on a device, for at least ``n`` blocks: ``(device, host)``."""
        scratch = self._scratch_tensors
        if scratch is None or scratch[1].shape[0] < n:
            torch = importlib.import_module("torch")
            blocks = self.buffer()
            shape = (max(n, 2 * scratch[1].shape[0] if scratch else 0), self.block_bytes)
            on_device = torch.empty(shape, dtype=torch.uint8, device=blocks.device)
            host = torch.empty(shape, dtype=torch.uint8, pin_memory=blocks.is_cuda)
            scratch = self._scratch_tensors = (on_device, host)
        return scratch

    def checksum(self, block_id: int) -> int:
        """The same checksum as :func:`page_checksum`, over what the block holds now."""
        return int(self.read(block_id).view(np.uint64).sum(dtype=np.uint64))
