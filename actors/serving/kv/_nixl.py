"""A thin, typed wrapper around one NIXL agent (UCX backend), with leak accounting.

NIXL's binding is untyped (:mod:`actors.serving.kv._nixl_binding` loads it), so every call goes
through
:class:`NixlAgent`, which keeps count of what is alive (registrations, remote agents, transfer
handles) so tests can assert that nothing leaked.

Agents are created with the progress thread OFF: on small CPU machines the default progress
thread busy-spins (every transfer then waits on it) and on GPUs it makes transfers slower.
The initiator therefore polls :meth:`NixlAgent.state` and the target polls
:meth:`NixlAgent.get_notifs`; both calls drive UCX progress. An agent is not thread-safe (no
listener thread, sync mode NONE): use it from one thread, the event loop's.

``num_threads`` > 0 gives the UCX backend a pool of posting threads (NIXL's
``nixlUcxThreadPoolEngine``), each with its own UCX worker: a transfer of at least
:data:`SPLIT_BATCH` descriptors is cut into chunks of ``max(n // num_threads, SPLIT_BATCH)``
consecutive descriptors, each posted and progressed by one of those threads, and completes (and
sends its notification, from the agent's own worker) once every chunk has. On one host UCX moves
host memory with ``process_vm_writev`` in the posting thread, a copy one thread cannot run at
memcpy speed; several threads can. Idle pool threads block; a thread polls only while it owns a
chunk. Smaller transfers are posted by the calling thread on the agent's own worker.
"""

from __future__ import annotations

import gc
import os
import secrets
import sys
import time
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from actors.serving.kv._nixl_binding import (
    AgentStatistics,
    DlistHandle,
    NixlError,
    Registration,
    XferHandle,
    XferState,
    call,
    load_nixl,
)
from protocols.kv import MemoryKind

__all__ = [
    "SPLIT_BATCH",
    "AgentStatistics",
    "DlistHandle",
    "NixlAgent",
    "NixlError",
    "Registration",
    "XferHandle",
    "XferState",
    "load_nixl",
]

SPLIT_BATCH = 4
"""With posting threads, the fewest descriptors a transfer needs to be split (UCX's
``split_batch_size``), and the descriptors each chunk of a split takes: above 1, so that a
one-descriptor transfer never pays a thread hop."""


class NixlAgent:
    """One NIXL agent with the UCX backend and the progress thread off.

    ``name`` must be unique among the agents that will meet; by default it is derived from
    ``prefix``, the pid and a random suffix. ``incarnation`` is random per agent: peers use it to
    tell a restarted agent from the one they knew, even under the same name. ``num_threads``:
    the UCX backend's posting threads (see the module's docstring; 0: none).
    """

    def __init__(self, name: str | None = None, *, prefix: str = "kv", num_threads: int = 0):
        if num_threads < 0:
            raise ValueError("num_threads must be >= 0")
        api = load_nixl()
        self.incarnation: int = secrets.randbits(63)
        self.name: str = name or f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"
        self.num_threads = num_threads
        """Posting threads of the UCX backend (0: the agent's own worker posts everything)."""
        config = api.nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=[]
        )
        self._agent: Any = call(
            f"creating NIXL agent {self.name!r}", api.nixl_agent, self.name, config
        )
        params = {}
        if num_threads:
            params = {"num_threads": str(num_threads), "split_batch_size": str(SPLIT_BATCH)}
        call("creating the UCX backend", self._agent.create_backend, "UCX", params)
        self._registrations: set[Registration] = set()
        self._remotes: set[str] = set()
        self._xfers: set[XferHandle] = set()
        self._dlists: set[DlistHandle] = set()
        self._posted = 0
        self._replaced = 0
        self._made = 0.0
        self.last_post: tuple[float, float] = (0.0, 0.0)
        """Seconds the last transfer took to create and to post (a benchmark probe)."""
        self._closed = False

    # -- memory -----------------------------------------------------------------------------

    def register(self, addr: int, size: int, mem_type: MemoryKind, device_id: int) -> Registration:
        """Register ``size`` bytes at ``addr`` (host memory or GPU ``device_id``) with UCX."""
        self._check_open()
        descs = call(
            f"register_memory({mem_type}, {size} B)",
            self._agent.register_memory,
            [(addr, size, device_id, "")],
            mem_type,
        )
        reg = Registration(descs, addr, size, mem_type, device_id)
        self._registrations.add(reg)
        return reg

    def deregister(self, reg: Registration) -> None:
        """Release a registration (idempotent)."""
        if reg not in self._registrations:
            return
        self._registrations.discard(reg)
        self._agent.deregister_memory(reg._descs)

    # -- peers ------------------------------------------------------------------------------

    def metadata(self) -> bytes:
        """This agent's metadata (connection info and registered memory) for its peers."""
        self._check_open()
        return bytes(self._agent.get_agent_metadata())

    def add_remote(self, metadata: bytes, name: str) -> str:
        """Load the metadata of peer ``name`` and connect to it; returns the loaded name.

        A peer that restarted under the same name must not be loaded on top of its stale entry
        (NIXL refuses with ``NOT_ALLOWED``, and stale UCX endpoints are a known crash class): the
        stale entry is removed first, and once more if NIXL still refuses.
        """
        self._check_open()
        if name in self._remotes:
            self.remove_remote(name)
            self._replaced += 1
        try:
            loaded = self._load(metadata)
        except NixlError:
            self.remove_remote(name, force=True)
            self._replaced += 1
            loaded = self._load(metadata)
        self._remotes.add(loaded)
        if loaded != name:
            self.remove_remote(loaded)
            raise NixlError(f"metadata names agent {loaded!r}, expected {name!r}")
        try:
            # Establish the UCX endpoint now, never on a request's path.
            self._agent.make_connection(loaded)
        except Exception:
            pass  # an optimisation only: the first transfer connects anyway
        return loaded

    def _load(self, metadata: bytes) -> str:
        raw = call("add_remote_agent", self._agent.add_remote_agent, metadata)
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def remove_remote(self, name: str, *, force: bool = False) -> None:
        """Forget a peer (disconnects it). Idempotent unless ``force`` (then errors are kept quiet
        too: a peer we never loaded cannot be removed)."""
        if name not in self._remotes and not force:
            return
        self._remotes.discard(name)
        try:
            self._agent.remove_remote_agent(name)
        except Exception:
            pass  # not loaded (anymore): nothing to remove

    def has_remote(self, name: str) -> bool:
        return name in self._remotes

    # -- transfers --------------------------------------------------------------------------

    def post(
        self,
        op: Literal["WRITE", "READ"],
        local: npt.NDArray[np.uint64],
        local_mem: MemoryKind,
        remote: npt.NDArray[np.uint64],
        remote_mem: MemoryKind,
        remote_agent: str,
        notif: bytes = b"",
    ) -> tuple[XferHandle, XferState]:
        """Create and post one transfer between ``local`` and ``remote`` descriptors.

        Descriptors are ``Nx3`` uint64 arrays of ``(address, length, device id)``. With a
        ``notif``, the remote agent receives it once the data has landed.
        """
        self._check_open()
        t0 = time.perf_counter()
        ldescs = call("get_xfer_descs", self._agent.get_xfer_descs, local, local_mem)
        rdescs = call("get_xfer_descs", self._agent.get_xfer_descs, remote, remote_mem)
        # No local may hold the binding's handle: an error's traceback keeps this frame, and
        # the handle keeps the agent (and UCX, and its sockets) alive.
        handle = XferHandle(
            call(
                f"initialize_xfer to {remote_agent!r}",
                self._agent.initialize_xfer,
                op,
                ldescs,
                rdescs,
                remote_agent,
                notif,
            ),
            remote_agent,
        )
        self._made = time.perf_counter() - t0
        return self._start(handle)

    def _start(self, handle: XferHandle) -> tuple[XferHandle, XferState]:
        self._xfers.add(handle)
        self._posted += 1
        t0 = time.perf_counter()
        try:
            state: XferState = call(
                f"transfer to {handle.remote!r}", self._agent.transfer, handle._handle
            )
        except NixlError as exc:
            error = exc
        else:
            self.last_post = (self._made, time.perf_counter() - t0)
            return handle, state
        # Posting failed (peer gone): let UCX finish the request before releasing it.
        for _ in range(100):
            if self.state(handle) != "PROC":
                break
        self.release(handle)
        raise error

    def prep_dlist(
        self, descs: npt.NDArray[np.uint64], mem: MemoryKind, remote_agent: str | None = None
    ) -> DlistHandle:
        """Prepare ``descs`` (``Nx3``) once: this agent's memory, or ``remote_agent``'s.

        Preparing resolves every descriptor against the registrations (and the peer's remote
        keys) up front, so a transfer built from it costs a fraction of one built from raw
        descriptor lists (which pays that on every request).
        """
        self._check_open()
        name = "NIXL_INIT_AGENT" if remote_agent is None else remote_agent
        handle = DlistHandle(
            call(f"prep_xfer_dlist({name})", self._agent.prep_xfer_dlist, name, descs, mem),
            name,
            int(descs.shape[0]),
        )
        self._dlists.add(handle)
        return handle

    def release_dlist(self, handle: DlistHandle) -> None:
        """Release a prepared list (idempotent); before its remote agent is removed."""
        if handle in self._dlists:
            self._dlists.discard(handle)
            try:
                handle._handle.release()
            except Exception:
                pass  # already gone with its agent
            handle._handle = None

    def post_prepped(
        self,
        local: DlistHandle,
        local_idx: npt.NDArray[np.int32],
        remote: DlistHandle,
        remote_idx: npt.NDArray[np.int32],
        notif: bytes = b"",
    ) -> tuple[XferHandle, XferState]:
        """Create and post one WRITE of ``local[local_idx]`` into ``remote[remote_idx]``."""
        self._check_open()
        t0 = time.perf_counter()
        handle = XferHandle(
            call(
                f"make_prepped_xfer to {remote.agent_name!r}",
                self._agent.make_prepped_xfer,
                "WRITE",
                local._handle,
                local_idx,
                remote._handle,
                remote_idx,
                notif,
            ),
            remote.agent_name,
        )
        self._made = time.perf_counter() - t0
        return self._start(handle)

    def state(self, handle: XferHandle) -> XferState:
        """Poll a transfer (drives UCX progress). Errors from the binding read as ``ERR``."""
        try:
            result: XferState = self._agent.check_xfer_state(handle._handle)
        except Exception:
            return "ERR"
        return result

    def release(self, handle: XferHandle) -> bool:
        """Release a transfer handle; for a transfer still in flight NIXL tries to cancel it.

        Returns ``False`` when NIXL could not release it (an active transfer it cannot cancel):
        the caller must keep polling and try again, and must not reuse the memory meanwhile.
        """
        if handle not in self._xfers:
            return True
        try:
            handle._handle.release()
        except Exception:
            return False
        self._xfers.discard(handle)
        handle._handle = None  # it references the agent: drop it so close() really frees UCX
        return True

    def get_notifs(self) -> dict[str, list[bytes]]:
        """New notifications, by sending agent name (drives UCX progress)."""
        self._check_open()
        raw: dict[Any, list[bytes]] = self._agent.get_new_notifs()
        return {(k.decode() if isinstance(k, bytes) else str(k)): v for k, v in raw.items()}

    # -- lifecycle --------------------------------------------------------------------------

    def statistics(self) -> AgentStatistics:
        return AgentStatistics(
            name=self.name,
            registrations=len(self._registrations),
            registered_bytes=sum(r.size for r in self._registrations),
            remote_agents=len(self._remotes),
            xfers_live=len(self._xfers),
            dlists_live=len(self._dlists),
            xfers_posted=self._posted,
            remote_agents_replaced=self._replaced,
            num_threads=self.num_threads,
        )

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release every transfer handle, remote agent and registration, then the agent."""
        if self._closed:
            return
        for handle in list(self._xfers):
            self.release(handle)
        for dlist in list(self._dlists):
            self.release_dlist(dlist)
        for name in list(self._remotes):
            self.remove_remote(name)
        for reg in list(self._registrations):
            self.deregister(reg)
        self._closed = True
        # Dropping the last reference destroys the UCX context and closes its sockets. A
        # reference cycle somewhere (a traceback) would postpone that to the next collection.
        extra = sys.getrefcount(self._agent) > 2
        self._agent = None
        if extra:
            gc.collect()

    def _check_open(self) -> None:
        if self._closed:
            raise NixlError(f"NIXL agent {self.name!r} is closed")

    def __enter__(self) -> NixlAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
