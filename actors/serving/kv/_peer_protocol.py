"""Commands, replies and page contents shared by a KV peer process and its driver.

Everything on the control socket is a msgspec struct (msgpack); nothing is pickled.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from actors.serving.kv._pool import KVPool
from protocols.engine import BootstrapInfo
from protocols.errors import RequestError

__all__ = [
    "Command",
    "Connect",
    "Outcome",
    "Prefill",
    "Receive",
    "Release",
    "Stats",
    "Stop",
    "WaitRoom",
    "fill_pattern",
    "pattern_pages",
    "read_pages",
]

_GOLDEN = 0x9E3779B97F4A7C15


# -- commands and replies -------------------------------------------------------------------


class Prefill(msgspec.Struct, tag="prefill", kw_only=True):
    """Open ``room`` now; fill pages with the pattern of ``seed`` and send them (once released,
    if ``hold``). ``pages`` (packed) picks explicit pages, else ``num_pages`` are allocated.
    ``corrupt`` flips a byte of that page *after* its checksum was taken."""

    room: int
    num_pages: int
    seed: int
    pages: bytes = b""
    corrupt: int = -1
    hold: bool = False


class Release(msgspec.Struct, tag="release", kw_only=True):
    room: int


class WaitRoom(msgspec.Struct, tag="wait", kw_only=True):
    """Reply with the room's outcome once it has one."""

    room: int


class Receive(msgspec.Struct, tag="receive", kw_only=True):
    """Decode: receive ``room`` from ``bootstrap`` into fresh pages, check the pattern bytes."""

    bootstrap: BootstrapInfo
    num_pages: int
    seed: int
    pages: bytes = b""
    verify: bool = True
    check_bytes: bool = True
    timeout: float = 30.0


class Connect(msgspec.Struct, tag="connect", kw_only=True):
    endpoint: str


class Stats(msgspec.Struct, tag="stats"):
    pass


class Stop(msgspec.Struct, tag="stop"):
    pass


Command = Prefill | Release | WaitRoom | Receive | Connect | Stats | Stop


class Outcome(msgspec.Struct, kw_only=True):
    """How a room ended on the peer's side (``code`` is a :mod:`protocols.errors` code)."""

    ok: bool
    code: str = ""
    message: str = ""
    nbytes: int = 0
    descriptors: int = 0
    seconds: float = 0.0
    endpoint: str = ""
    info: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)


class Envelope(msgspec.Struct, array_like=True):
    id: int
    body: Command


class ReplyEnvelope(msgspec.Struct, array_like=True):
    id: int
    body: Outcome


# -- page contents ----------------------------------------------------------------------------


def pattern_pages(seed: int, count: int, page_bytes: int) -> npt.NDArray[np.uint8]:
    """``count`` pages of deterministic content: page ``k`` of a request depends on (seed, k)."""
    words = page_bytes // 8
    idx = np.arange(words, dtype=np.uint64)
    keys = (np.uint64(seed & 0xFFFFFFFF) << np.uint64(32)) + np.arange(count, dtype=np.uint64)
    grid = (idx[None, :] + keys[:, None] * np.uint64(_GOLDEN)) * np.uint64(0xBF58476D1CE4E5B9)
    return grid.view(np.uint8).reshape(count, page_bytes)


def fill_pattern(pool: KVPool, pages: npt.NDArray[np.int64], seed: int) -> None:
    """Write :func:`pattern_pages` into ``pages`` of ``pool`` (host or GPU)."""
    data = pattern_pages(seed, int(pages.size), pool.page_bytes)
    host = pool.host_view
    if host is not None:
        host[pages] = data
        return
    import torch

    tensor = pool.tensor_view
    assert tensor is not None
    index = torch.tensor(pages, device=tensor.device)  # a copy: pages may be read-only
    tensor.index_copy_(0, index, torch.from_numpy(data).to(tensor.device))
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def read_pages(pool: KVPool, pages: npt.NDArray[np.int64]) -> npt.NDArray[np.uint8]:
    host = pool.host_view
    if host is not None:
        return host[pages]
    tensor = pool.tensor_view
    assert tensor is not None
    import torch

    index = torch.tensor(pages, device=tensor.device)  # a copy: pages may be read-only
    out: npt.NDArray[np.uint8] = tensor.index_select(0, index).cpu().numpy()
    return out


def failed(exc: BaseException) -> Outcome:
    if isinstance(exc, RequestError):
        code, message = exc.to_wire()
        return Outcome(ok=False, code=code, message=message)
    return Outcome(ok=False, code="internal", message=f"{type(exc).__name__}: {exc}")
