"""Our own KV transfer for engines that do not move KV themselves (the mock, the hf engine).

The engine's KV buffer is registered with NIXL once (as a :class:`~actors.kv.KVPool`), and:

- on a prefill worker, a request's room is opened *before* its first output is published; once
  the engine finished the prompt, its pages are WRITTEN into the decode worker's pages (which the
  decode side sent as its page list) and only then released — never freed while decode reads;
- on a decode worker, the engine allocates the prompt's pages, the bridge receives them, and the
  engine verifies every page against the tokens before it decodes (``KVCorrupted`` otherwise).

Engines with their own transfer (SGLang's NIXL connector) never get a bridge.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from actors.engines import FAKE_BOOTSTRAP_HOST
from protocols.engine import Capacity, EngineOutput, PreprocessedRequest
from protocols.errors import KVTransferError

__all__ = ["KVBridge", "needs_transfer"]


def needs_transfer(request: PreprocessedRequest) -> bool:
    info = request.bootstrap_info
    return info is not None and info.host != FAKE_BOOTSTRAP_HOST


class KVBridge:
    """One worker's NIXL side: a PrefillKV or DecodeKV over the engine's KV buffer."""

    def __init__(
        self, engine: Any, role: str, worker_id: str, fault: Callable[[str], bool] = lambda _: False
    ) -> None:
        self.engine = engine
        self.role = role
        self.worker_id = worker_id
        self._fault = fault  # test and scenario fault injection (``corrupt_kv``)
        self._stack = contextlib.AsyncExitStack()
        self.service: Any = None
        self.pool: Any = None
        self.endpoint: str | None = None

    async def __aenter__(self) -> KVBridge:
        from actors.kv import DecodeKV, KVPool, NixlAgent, PrefillKV

        memory = self.engine.kv_memory(0)
        self.pool = KVPool.from_buffer(self.engine.kv_buffer(0), memory.block_bytes)
        agent = NixlAgent(f"{self.role}-{self.worker_id}-{os.getpid()}")
        self._stack.callback(agent.close)
        self._stack.callback(self.pool.close)
        if self.role == "prefill":
            path = f"ipc:///tmp/actorserve-kv-{os.getpid()}-{self.worker_id}.sock"
            self.service = await self._stack.enter_async_context(
                PrefillKV(agent, self.pool, endpoint=path, worker_id=self.worker_id)
            )
            self.endpoint = self.service.endpoint
        else:
            self.service = await self._stack.enter_async_context(
                DecodeKV(agent, self.pool, worker_id=self.worker_id)
            )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    def capacity(self, capacity: Capacity) -> Capacity:
        """The engine's capacity, with the bootstrap endpoint decode peers must meet."""
        if self.endpoint is None:
            return capacity
        from actors.kv import bootstrap_info

        return msgspec.structs.replace(capacity, bootstrap=bootstrap_info(self.endpoint, 0))

    async def connect(self, endpoint: str) -> None:
        """Decode: meet a prefill worker ahead of its first request (pre-warm)."""
        if self.role == "decode":
            await self.service.connect(endpoint)

    async def prefill(self, request: PreprocessedRequest) -> AsyncIterator[EngineOutput]:
        """Run the prompt; then WRITE its pages to decode; the stream ends when the transfer has
        reached a terminal state."""
        assert request.bootstrap_info is not None
        engine, rid = self.engine, request.rid
        with self.service.open_room(request.bootstrap_info.room) as room:
            outputs = engine.generate(request)
            try:
                async for output in outputs:
                    yield output
            finally:
                await outputs.aclose()
            source = await engine.wait_transfer_source(rid)
            try:
                await room.send(list(source.block_ids))
            finally:
                engine.release_transfer(rid)

    async def decode(self, request: PreprocessedRequest) -> AsyncIterator[EngineOutput]:
        """Take the prompt's pages from prefill, then decode from them."""
        assert request.bootstrap_info is not None
        engine, rid = self.engine, request.rid
        outputs = engine.generate(request)
        try:
            target = await engine.wait_transfer_target(rid)
            pages = self.pool.alloc_exact(list(target.block_ids))
            try:
                await self.service.receive(request.bootstrap_info, pages, verify=False)
            except KVTransferError as exc:
                engine.fail_transfer(rid, str(exc))
                raise
            except Exception as exc:
                engine.fail_transfer(rid, f"{type(exc).__name__}: {exc}")
                raise KVTransferError(f"{type(exc).__name__}: {exc}") from exc
            pages.free()
            if self._fault("corrupt_kv"):
                # Fault injection: one flipped byte in the first received page.
                buffer = engine.kv_buffer(target.dp_rank)
                buffer[target.block_ids[0], 0] ^= 0xFF
            engine.complete_transfer(rid)
            async for output in outputs:
                yield output
        finally:
            await outputs.aclose()
