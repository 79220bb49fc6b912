"""NIXL's untyped Python binding: finding it, calling it, and the typed records of an agent.

NIXL ships as ``nixl`` (meta package) or as ``nixl_cu13`` / ``nixl_cu12``; :func:`load_nixl` finds
whichever is installed. The module is untyped, so it is held as ``Any``; :func:`call` turns the
binding's errors into :class:`NixlError`. The handle and record types here are what
:class:`~actors.serving.kv._nixl.NixlAgent` hands out.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

from actors.serving.errors import NixlError
from protocols.kv import MemoryKind

__all__ = [
    "AgentStatistics",
    "DlistHandle",
    "NixlError",
    "Registration",
    "XferHandle",
    "XferState",
    "call",
    "load_nixl",
]

XferState = Literal["DONE", "PROC", "ERR"]

_CANDIDATES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")
_api: ModuleType | None = None


def call(what: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)``, with any binding error turned into a :class:`NixlError` raised outside the
    ``except`` block (so that neither ``__cause__`` nor ``__context__`` keeps NIXL's frames)."""
    try:
        return fn(*args)
    except Exception as exc:
        message = f"{what} failed: {type(exc).__name__}: {exc}"
    del fn, args  # the error's traceback keeps this frame: it must not keep the agent
    raise NixlError(message)


def load_nixl() -> Any:
    """Import NIXL's Python API from whichever distribution is installed (cached).

    NIXL's Python logger prints INFO lines to stdout; it is turned down to WARNING unless
    ``NIXL_LOG_LEVEL`` asks otherwise.
    """
    global _api
    if _api is None:
        # UCX's TCP transport would listen on every interface: keep it on loopback unless the
        # operator chose devices (multi-host deployments set UCX_NET_DEVICES themselves).
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
        errors: list[str] = []
        for name in _CANDIDATES:
            try:
                _api = importlib.import_module(name)
                break
            except ModuleNotFoundError as exc:
                errors.append(f"{name}: {exc}")
        else:
            raise ModuleNotFoundError("NIXL is not installed (" + "; ".join(errors) + ")")
        if not os.environ.get("NIXL_LOG_LEVEL"):
            logging.getLogger("nixl").setLevel(logging.WARNING)
    return _api


@dataclass(frozen=True, slots=True)
class AgentStatistics:
    """What an agent holds right now, and what it did."""

    name: str
    registrations: int
    registered_bytes: int
    remote_agents: int
    xfers_live: int
    xfers_posted: int
    dlists_live: int
    remote_agents_replaced: int
    num_threads: int


class Registration:
    """One registered memory region; :meth:`~actors.serving.kv._nixl.NixlAgent.deregister` releases
    it."""

    __slots__ = ("_descs", "addr", "device_id", "mem_type", "size")

    def __init__(self, descs: Any, addr: int, size: int, mem_type: MemoryKind, device_id: int):
        self._descs = descs
        self.addr = addr
        self.size = size
        self.mem_type: MemoryKind = mem_type
        self.device_id = device_id


class XferHandle:
    """A posted (or prepared) transfer; release it with
    :meth:`~actors.serving.kv._nixl.NixlAgent.release`."""

    __slots__ = ("_handle", "remote")

    def __init__(self, handle: Any, remote: str) -> None:
        self._handle = handle
        self.remote = remote


class DlistHandle:
    """A descriptor list prepared once (all pages of a pool, local or a peer's): transfers then
    name pages by index, and NIXL merges consecutive ones into one descriptor."""

    __slots__ = ("_handle", "agent_name", "size")

    def __init__(self, handle: Any, agent_name: str, size: int) -> None:
        self._handle = handle
        self.agent_name = agent_name
        self.size = size
