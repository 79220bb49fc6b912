"""Giving freed memory back to the OS after an engine drops its weights (torch-free)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

__all__ = ["free_heap", "malloc_trim"]


def malloc_trim() -> None:
    """Hand freed heap memory back to the OS (glibc keeps it otherwise; RSS would not drop)."""
    name = ctypes.util.find_library("c")
    if name:
        libc = ctypes.CDLL(name)
        if hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)


def free_heap() -> None:
    """Collect what was let go of (cycles included), then hand the heap back to the OS."""
    gc.collect()
    malloc_trim()
