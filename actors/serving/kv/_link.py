"""Prefill's NIXL side of its decode peers: loading, warming up and dropping them.

When a decode peer says ``Hello``, its metadata is loaded (``add_remote_agent``), the UCX
connection is wired up with a small READ of the peer's pool, and the peer pool's pages are
prepared as one descriptor list: all of it when the peers first meet, never on a request's path.
"""

from __future__ import annotations

import numpy as np

from actors.serving.kv._nixl import DlistHandle, NixlAgent, NixlError
from actors.serving.kv._pool import KVPool
from actors.serving.kv._transfer import page_table, probe_peer
from protocols.kv import KVMemoryDesc

__all__ = ["PeerLinks"]


class PeerLinks:
    """The prefill agent's links to decode agents, and what they share (a prepared list of the
    local pool's pages, a scratch buffer for warm-up READs)."""

    SCRATCH = 64

    def __init__(self, agent: NixlAgent, pool: KVPool, *, prepare: bool) -> None:
        self._agent = agent
        self._prepare = prepare
        self._keep: object
        if pool.mem_type == "DRAM":
            buf = np.zeros(self.SCRATCH, dtype=np.uint8)
            addr = int(buf.ctypes.data)
            self._keep = buf
        else:
            import torch

            dev = f"cuda:{pool.device_id}"
            tensor = torch.zeros(self.SCRATCH, dtype=torch.uint8, device=dev)
            addr = int(tensor.data_ptr())
            self._keep = tensor
        self._scratch = KVMemoryDesc(
            mem_type=pool.mem_type,
            device_id=pool.device_id,
            base_addr=addr,
            num_pages=1,
            page_bytes=self.SCRATCH,
        )
        self._reg = agent.register(addr, self.SCRATCH, pool.mem_type, pool.device_id)
        mine = pool.memory_desc()
        self.local: DlistHandle | None = (
            agent.prep_dlist(page_table(mine), mine.mem_type) if prepare else None
        )

    async def connect(
        self, metadata: bytes, name: str, memory: KVMemoryDesc, *, timeout: float
    ) -> DlistHandle | None:
        """Load and warm up peer ``name``; returns its prepared page list (or ``None`` when lists
        are not prepared). Raises :class:`NixlError` (nothing is left loaded then)."""
        agent = self._agent
        agent.add_remote(metadata, name)
        size = min(self.SCRATCH, memory.page_bytes)
        scratch = np.array([[self._scratch.base_addr, size, self._scratch.device_id]], np.uint64)
        await probe_peer(agent, scratch, self._scratch, memory, name, timeout=timeout)
        if not self._prepare:
            return None
        try:
            return agent.prep_dlist(page_table(memory), memory.mem_type, name)
        except NixlError:
            agent.remove_remote(name)
            raise

    def disconnect(self, name: str, dlist: DlistHandle | None) -> None:
        """Drop peer ``name`` (its WRITEs must have settled): its list, then its agent."""
        if self._agent.closed:
            return
        if dlist is not None:
            self._agent.release_dlist(dlist)
        self._agent.remove_remote(name)

    def close(self) -> None:
        if self._agent.closed:
            return
        if self.local is not None:
            self._agent.release_dlist(self.local)
            self.local = None
        self._agent.deregister(self._reg)
