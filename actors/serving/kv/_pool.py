"""The KV page pool: one contiguous region per worker, registered with NIXL once, cut in pages.

The region is host memory (a numpy array, or a CPU torch tensor) or GPU memory (a CUDA torch
tensor). A pool either allocates its own region (:meth:`KVPool.allocate`) or adopts one an engine
already owns (:meth:`KVPool.from_buffer`, :meth:`KVPool.from_address`), so the engine's KV cache
itself is what NIXL reads and writes.

The allocator hands out pages in contiguous runs whenever it can (best fit over free extents):
a request whose pages are contiguous on both sides moves as one NIXL descriptor, which is what
makes transfers run at copy speed instead of paying a few microseconds per page.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from actors.serving.kv._alloc import Extents, runs
from actors.serving.kv._nixl import NixlAgent, Registration
from protocols.errors import Overloaded
from protocols.kv import KVMemoryDesc, MemoryKind

if TYPE_CHECKING:
    import torch

__all__ = ["KVPool", "KVPoolExhausted", "PageAllocation", "PoolStatistics", "as_page_array"]

PageArray = npt.NDArray[np.int64]


class KVPoolExhausted(Overloaded):
    """Not enough free KV pages for the request."""

    code = "capacity.kv_pool_exhausted"


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    """A pool's occupancy and registration state."""

    num_pages: int
    page_bytes: int
    pages_in_use: int
    pages_free: int
    allocations_live: int
    largest_free_run: int
    registered: bool
    mem_type: MemoryKind
    device_id: int


def as_page_array(pages: PageAllocation | PageArray | list[int] | tuple[int, ...]) -> PageArray:
    """Page indices as a read-only int64 array."""
    if isinstance(pages, PageAllocation):
        return pages.pages
    if isinstance(pages, list | tuple):
        # Half the time of converting the sequence (a context's pages, per live migration).
        return np.fromiter(pages, dtype=np.int64, count=len(pages))
    arr = np.ascontiguousarray(pages, dtype=np.int64)
    return arr.reshape(-1)


class PageAllocation:
    """Pages held from a pool until :meth:`free` (idempotent; also on context exit)."""

    __slots__ = ("_freed", "_on_free", "_runs", "pages", "pool")

    def __init__(
        self, pool: KVPool, pages: PageArray, runs: list[tuple[int, int]] | None = None
    ) -> None:
        self.pool = pool
        pages.setflags(write=False)
        self.pages: PageArray = pages
        self._runs = runs  # the pages as sorted runs, if the allocation worked them out
        self._freed = False
        self._on_free: Callable[[], None] | None = None

    def __len__(self) -> int:
        return int(self.pages.size)

    @property
    def freed(self) -> bool:
        return self._freed

    def free(self) -> None:
        """Give the pages back to the pool (once; later calls do nothing)."""
        if not self._freed:
            self._freed = True
            self.pool._release(self)
            on_free, self._on_free = self._on_free, None
            if on_free is not None:
                on_free()

    def on_free(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the pages are freed (at once if they are): an engine that
        shares the pool's memory keeps them out of its own use until then."""
        if self._freed:
            callback()
        else:
            self._on_free = callback

    def __enter__(self) -> PageAllocation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def __repr__(self) -> str:
        return f"PageAllocation({self.pages.size} pages, freed={self._freed})"


class KVPool:
    """``num_pages`` KV pages of ``page_bytes`` each, in one region registered with NIXL."""

    def __init__(
        self,
        *,
        page_bytes: int,
        nbytes: int,
        base_addr: int,
        mem_type: MemoryKind,
        device_id: int,
        host: npt.NDArray[np.uint8] | None,
        tensor: torch.Tensor | None,
        keepalive: object = None,
    ) -> None:
        if page_bytes <= 0 or page_bytes % 8:
            raise ValueError("page_bytes must be a positive multiple of 8")
        if nbytes < page_bytes:
            raise ValueError("the region holds no whole page")
        self.page_bytes = page_bytes
        self.num_pages = nbytes // page_bytes
        self.base_addr = base_addr
        self.mem_type: MemoryKind = mem_type
        self.device_id = device_id
        self._host = host
        self._tensor = tensor
        self._keepalive = keepalive
        self._extents = Extents(self.num_pages)
        self._live: set[PageAllocation] = set()
        self._agent: NixlAgent | None = None
        self._registration: Registration | None = None

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def allocate(cls, num_pages: int, page_bytes: int, *, device: str | None = None) -> KVPool:
        """A fresh zeroed region: on ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"``), by default
        on the GPU when torch sees one, else in host memory (a numpy array)."""
        if device is None:
            device = "cuda" if _cuda_available() else "cpu"
        nbytes = num_pages * page_bytes
        if device == "cpu":
            # Write every page now (np.zeros alone maps them lazily): the first transfer into
            # a page must not pay its page fault.
            buf = np.empty(nbytes, dtype=np.uint8)
            buf.fill(0)
            return cls.from_buffer(buf, page_bytes)
        import torch

        return cls.from_buffer(torch.zeros(nbytes, dtype=torch.uint8, device=device), page_bytes)

    @classmethod
    def from_buffer(cls, buffer: npt.NDArray[Any] | torch.Tensor, page_bytes: int) -> KVPool:
        """Adopt an engine's existing KV buffer (C-contiguous numpy array or torch tensor).

        The pool keeps a reference to ``buffer``; its bytes are the pages, in order.
        """
        if isinstance(buffer, np.ndarray):
            if not buffer.flags.c_contiguous:
                raise ValueError("the buffer must be C-contiguous")
            host = buffer.reshape(-1).view(np.uint8)
            return cls(
                page_bytes=page_bytes,
                nbytes=host.nbytes,
                base_addr=int(host.ctypes.data),
                mem_type="DRAM",
                device_id=0,
                host=host,
                tensor=None,
                keepalive=buffer,
            )
        if not buffer.is_contiguous():
            raise ValueError("the tensor must be contiguous")
        import torch

        flat = buffer.reshape(-1).view(torch.uint8)
        if flat.device.type == "cpu":
            host = flat.numpy()
            return cls(
                page_bytes=page_bytes,
                nbytes=host.nbytes,
                base_addr=int(flat.data_ptr()),
                mem_type="DRAM",
                device_id=0,
                host=host,
                tensor=None,
                keepalive=buffer,
            )
        return cls(
            page_bytes=page_bytes,
            nbytes=flat.numel(),
            base_addr=int(flat.data_ptr()),
            mem_type="VRAM",
            device_id=int(flat.device.index or 0),
            host=None,
            tensor=flat,
            keepalive=buffer,
        )

    @classmethod
    def from_address(
        cls,
        addr: int,
        size: int,
        page_bytes: int,
        *,
        mem_type: MemoryKind = "DRAM",
        device_id: int = 0,
        keepalive: object = None,
    ) -> KVPool:
        """Adopt raw memory at ``addr`` (``keepalive`` is whatever keeps it allocated).

        Host memory is viewed through numpy; GPU memory through torch (via the CUDA array
        interface), so checksums and page views work on adopted memory too.
        """
        if mem_type == "DRAM":
            import ctypes

            raw = (ctypes.c_uint8 * size).from_address(addr)
            host = np.frombuffer(memoryview(raw).cast("B"), dtype=np.uint8)
            return cls(
                page_bytes=page_bytes,
                nbytes=size,
                base_addr=addr,
                mem_type="DRAM",
                device_id=0,
                host=host,
                tensor=None,
                keepalive=(keepalive, raw),
            )
        import torch

        iface = _CudaArray(addr, size)
        tensor = torch.as_tensor(iface, device=f"cuda:{device_id}")
        return cls(
            page_bytes=page_bytes,
            nbytes=size,
            base_addr=addr,
            mem_type="VRAM",
            device_id=device_id,
            host=None,
            tensor=tensor,
            keepalive=(keepalive, iface),
        )

    # -- views --------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def host_view(self) -> npt.NDArray[np.uint8] | None:
        """``(num_pages, page_bytes)`` uint8 view of host memory (``None`` for a GPU pool)."""
        if self._host is None:
            return None
        return self._host[: self.nbytes].reshape(self.num_pages, self.page_bytes)

    @property
    def tensor_view(self) -> torch.Tensor | None:
        """``(num_pages, page_bytes)`` uint8 view of GPU memory (``None`` for a host pool)."""
        if self._tensor is None:
            return None
        return self._tensor[: self.nbytes].view(self.num_pages, self.page_bytes)

    def memory_desc(self) -> KVMemoryDesc:
        """The pool's layout, as a peer needs it to address pages."""
        return KVMemoryDesc(
            mem_type=self.mem_type,
            device_id=self.device_id,
            base_addr=self.base_addr,
            num_pages=self.num_pages,
            page_bytes=self.page_bytes,
        )

    # -- registration -----------------------------------------------------------------------

    def register(self, agent: NixlAgent) -> None:
        """Register the whole region with ``agent`` (once; a pool belongs to one agent)."""
        if self._registration is not None:
            if self._agent is agent:
                return
            raise RuntimeError("the pool is already registered with another agent")
        self._registration = agent.register(
            self.base_addr, self.nbytes, self.mem_type, self.device_id
        )
        self._agent = agent

    @property
    def registered(self) -> bool:
        return self._registration is not None

    def close(self) -> None:
        """Deregister the region (idempotent). Allocations still live are a caller's leak."""
        agent = self._agent
        if self._registration is not None and agent is not None and not agent.closed:
            agent.deregister(self._registration)
        self._registration = None
        self._agent = None

    # -- allocation ---------------------------------------------------------------------------

    def alloc(self, num_pages: int) -> PageAllocation:
        """``num_pages`` free pages, contiguous when any free run is long enough."""
        if num_pages <= 0:
            raise ValueError("num_pages must be positive")
        if num_pages > self._extents.free:
            raise KVPoolExhausted(f"{num_pages} pages asked, {self._extents.free} free")
        return self._track(self._extents.take(num_pages))

    def alloc_exact(self, pages: PageArray | list[int] | tuple[int, ...]) -> PageAllocation:
        """Exactly these pages (each must be free), in this order: scattered layouts, tests."""
        arr = as_page_array(pages)
        spans = runs(arr)
        # Runs already in ascending order (a context's pages, mostly one run) need no sort.
        if any(a + n > b for (a, n), (b, _) in pairwise(spans)):
            spans = runs(np.sort(arr))
        if not spans or spans[0][0] < 0 or sum(spans[-1]) > self.num_pages:
            raise ValueError("page index out of range")
        taken: list[tuple[int, int]] = []
        for first, count in spans:
            if not self._extents.claim(first, count):
                for f, c in taken:
                    self._extents.give(f, c)
                raise KVPoolExhausted(f"pages {first}..{first + count - 1} are not all free")
            taken.append((first, count))
        return self._track(arr.copy(), taken)  # its runs, for its release

    def _track(self, pages: PageArray, runs: list[tuple[int, int]] | None = None) -> PageAllocation:
        alloc = PageAllocation(self, pages, runs)
        self._live.add(alloc)
        return alloc

    def _release(self, alloc: PageAllocation) -> None:
        self._live.discard(alloc)
        taken = alloc._runs
        for first, count in runs(np.sort(alloc.pages)) if taken is None else taken:
            self._extents.give(first, count)

    def free(self, alloc: PageAllocation) -> None:
        """Same as ``alloc.free()``."""
        alloc.free()

    def statistics(self) -> PoolStatistics:
        in_use = self.num_pages - self._extents.free
        return PoolStatistics(
            num_pages=self.num_pages,
            page_bytes=self.page_bytes,
            pages_in_use=in_use,
            pages_free=self._extents.free,
            allocations_live=len(self._live),
            largest_free_run=self._extents.largest(),
            registered=self.registered,
            mem_type=self.mem_type,
            device_id=self.device_id,
        )


class _CudaArray:
    """Exposes raw device memory to ``torch.as_tensor`` without a copy."""

    def __init__(self, addr: int, size: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (addr, False),
            "version": 3,
        }


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
