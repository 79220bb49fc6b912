"""The engine actor's body: owns one engine (mock, hf or sglang) and serves the contract.

It runs inside the engine's own OS process (a process actor), so a CUDA fault or an OOM kill
takes down only this process. It is the only caller of the engine's ``cleanup``.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.abc
import msgspec

from actors import Actor, ExitReason, ReplyError
from actors.serving.worker._kvbridge import KVBridge, needs_transfer
from protocols import control as c
from protocols.engine import (
    Engine,
    EngineOutput,
    MemoryTag,
    PauseMode,
    PreprocessedRequest,
)
from protocols.errors import EngineFailure, EngineShutdown, RequestError, WorkerDraining

__all__ = ["EngineHost", "InjectedCrash", "build_engine"]


class InjectedCrash(Exception):
    """Raised by ``control.Perturb("crash")``: a fault injected into the engine actor."""


def build_engine(backend: str, config: bytes, task_group: Any) -> Engine:
    """The engine for ``backend`` from its msgpack-encoded config."""
    if backend == "mock":
        from actors.serving.engines import MockEngine, MockEngineConfig

        return MockEngine(
            msgspec.msgpack.decode(config, type=MockEngineConfig), task_group=task_group
        )
    if backend == "hf":
        from actors.serving.engines import HFEngine, decode_config

        return HFEngine(decode_config(config))
    if backend == "sglang":
        from actors.serving.engines import SGLangEngine

        options = msgspec.msgpack.decode(config)
        return SGLangEngine(options.pop("server_args"), **options)
    raise ValueError(f"unknown engine backend {backend!r} (mock, hf, sglang)")


class EngineHost(Actor):
    """Serves ``protocols.control`` messages and generation streams for one engine."""

    reply_errors = (RequestError,)

    def __init__(self, backend: str, config: bytes, worker_id: str = "") -> None:
        self.backend = backend
        self.config = config
        self.worker_id = worker_id or f"worker-{os.getpid()}"
        self.bridge: KVBridge | None = None
        self._bridge_closing: anyio.Event | None = None  # the bridge's task: close it
        self._bridge_closed: anyio.Event | None = None  # the bridge's task: it is closed
        self.engine: Engine | None = None
        self.running = 0
        self.streaming = 0  # of which have streamed an output
        self.finished = 0
        self.last_output = time.monotonic()
        self._capacity: Any = None
        self.admitting = True
        self._running: set[str] = set()
        # A drained request's end (the migratable error its stream raises), from the drain on.
        self._handed_over: dict[str, RequestError] = {}
        self._handovers = {"live": 0, "replay": 0}
        self._faults: dict[str, int] = {}

    async def started(self) -> None:
        self.engine = build_engine(self.backend, self.config, self.task_group)
        try:
            self._capacity = await self.engine.start()
            await self._open_bridge()
        except BaseException:
            await self._close_bridge()
            await self.engine.cleanup()
            raise

    async def stopping(self, reason: ExitReason) -> None:
        await self._close_bridge()
        if self.engine is not None:
            await self.engine.cleanup()

    async def _open_bridge(self) -> None:
        role = getattr(getattr(self.engine, "config", None), "role", "aggregated")
        if self.backend == "sglang" or role not in ("prefill", "decode") or self.bridge is not None:
            return
        bridge = KVBridge(self.engine, role, self.worker_id, self._take_fault)
        self.bridge = await self.task_group.start(self._keep_bridge, bridge)

    async def _keep_bridge(
        self, bridge: KVBridge, *, task_status: anyio.abc.TaskStatus[KVBridge]
    ) -> None:
        # The bridge lives in a task of its own: its task groups must be entered and exited by
        # one task, and not from a handler (a remote ask runs in a cancel scope of its own).
        closing = self._bridge_closing = anyio.Event()
        closed = self._bridge_closed = anyio.Event()
        try:
            async with bridge:
                task_status.started(bridge)
                await closing.wait()
        finally:
            closed.set()

    async def _close_bridge(self) -> None:
        bridge, self.bridge = self.bridge, None
        if bridge is not None:
            assert self._bridge_closing is not None and self._bridge_closed is not None
            self._bridge_closing.set()
            await self._bridge_closed.wait()

    async def receive(self, message: Any) -> Any:
        engine = self.engine
        assert engine is not None
        match message:
            case c.GetCapacity():
                return (
                    self.bridge.capacity(self._capacity)
                    if self.bridge is not None
                    else self._capacity
                )
            case c.ConnectPeer(endpoint=endpoint):
                # In the background: a prefill that is gone must not hold this mailbox.
                if self.bridge is not None:
                    self.bridge.connect_soon(endpoint)
            case c.Abort(rid=rid):
                # A handed-over request's pages go once its room is terminal, not before.
                if self.bridge is None or not self.bridge.abort_handover(rid):
                    await engine.abort(rid)
            case c.Pause(mode=mode):
                self._fault("pause")
                await engine.pause(mode)
            case c.ContinueGeneration():
                await engine.continue_generation()
            case c.ReleaseMemory(tags=tags):
                self._fault("release_memory")
                if MemoryTag.KV_CACHE in tags:
                    await self._close_bridge()  # the registered KV buffer is about to go
                await engine.release_memory(tags)
            case c.ResumeMemory(tags=tags):
                self._fault("resume_memory")
                await engine.resume_memory(tags)
                if MemoryTag.KV_CACHE in tags:
                    await self._open_bridge()  # a new buffer: register it again
            case c.Drain(handover=handover, shutdown=shutdown, live=live):
                await self._drain(handover, shutdown, live and not shutdown)
            case c.Undrain(continue_generation=continue_generation):
                if continue_generation:
                    await engine.continue_generation()
                self.admitting = True
            case c.InjectFault(operation=operation, count=count):
                self._faults[operation] = self._faults.get(operation, 0) + count
            case c.FlushCache():
                return await engine.flush_cache()
            case c.IsQuiescent():
                return engine.is_quiescent()
            case c.GetHealthPayload():
                self._fault("health")
                return engine.health_payload()
            case c.Perturb(action=action, factor=factor):
                await self._perturb(action, factor)
            case c.GetStats():
                released = getattr(engine, "released_tags", ())
                native = engine.statistics() if hasattr(engine, "statistics") else None
                return c.EngineStats(
                    running=self.running,
                    streaming=self.streaming,
                    finished=self.finished,
                    last_output=self.last_output,
                    released=tuple(released() if callable(released) else released),
                    quiescent=engine.is_quiescent(),
                    kv_used_blocks=getattr(native, "used_blocks", -1),
                    engine_in_flight=getattr(native, "in_flight", -1),
                    pid=os.getpid(),
                    admitting=self.admitting,
                    prefill_tokens=getattr(native, "prefill_tokens", -1),
                    kv_received_tokens=getattr(native, "kv_received_tokens", -1),
                    handovers_live=self._handovers["live"],
                    handovers_replay=self._handovers["replay"],
                    handovers_open=self.bridge.handovers_open if self.bridge else 0,
                    kv_write_seconds=self.bridge.write_seconds() if self.bridge else 0.0,
                    transfer_pages=self.bridge.transfer_pages() if self.bridge else 0,
                )
            case _:
                return await super().receive(message)
        return None

    async def _perturb(self, action: str, factor: float) -> None:
        """Fault injection (scenarios): see ``protocols.control.Perturb``."""
        assert self.engine is not None
        if action == "crash":
            # Not a reply error: it escapes the handler and crashes this actor.
            raise InjectedCrash("injected crash of the engine actor's handler")
        if action == "hang":
            # Straight to the engine, not through our own pause bookkeeping: from the outside
            # this must look like an engine that stopped making progress, nothing else.
            await self.engine.pause(PauseMode.IN_PLACE)
        elif action == "unhang":
            await self.engine.continue_generation()
        elif action == "slow" and hasattr(self.engine, "slow_down"):
            self.engine.slow_down(factor)
        else:
            raise ReplyError(f"cannot perturb a {self.backend} engine with {action!r}")

    def _take_fault(self, operation: str) -> bool:
        left = self._faults.get(operation, 0)
        if left:
            self._faults[operation] = left - 1
        return bool(left)

    def _fault(self, operation: str) -> None:
        if self._take_fault(operation):
            raise EngineFailure(f"injected fault in {operation}")

    async def _drain(self, handover: bool, shutdown: bool, live: bool) -> None:
        self.admitting = False
        if not handover:
            return
        error: RequestError = (
            EngineShutdown("the worker shut down")
            if shutdown
            else WorkerDraining("the worker is draining")
        )
        assert self.engine is not None
        # A drain again finds some already on their way out. Each one's end is recorded before
        # its stream can see it.
        rids = [rid for rid in self._running if rid not in self._handed_over]
        self._handed_over.update(dict.fromkeys(rids, error))
        if live and self.bridge is not None:
            # Every decoding request, offered on its stream now and handed over at one step
            # boundary of the engine (one that ended meanwhile is left out).
            offers = await self.bridge.hand_over(rids)
        else:
            offers = dict.fromkeys(rids)
        for offer in offers.values():
            self._handovers["replay" if offer is None else "live"] += 1
        for rid, offer in offers.items():
            if offer is None:
                await self.engine.abort(rid)

    def _outputs(self, request: PreprocessedRequest) -> AsyncIterator[EngineOutput]:
        assert self.engine is not None
        bridge = self.bridge
        if bridge is not None and needs_transfer(request):
            if bridge.role == "prefill":
                return bridge.prefill(request)
            return bridge.decode(request)
        return self.engine.generate(request)

    async def receive_stream(self, message: Any) -> AsyncIterator[EngineOutput]:
        if isinstance(message, c.WaitQuiescent):
            # A stream, not an ask: a drain may take long, and the mailbox must keep serving
            # meanwhile (aborts of handed-over requests, health checks, statistics).
            waiter = getattr(self.engine, "wait_quiescent", None)
            if waiter is None:
                raise ReplyError("this engine cannot wait for quiescence")
            await waiter()
            return
        if not isinstance(message, PreprocessedRequest):
            raise ReplyError(f"expected a PreprocessedRequest, got {type(message).__name__}")
        assert self.engine is not None
        if not self.admitting and not message.health_check:
            raise WorkerDraining("the worker is not accepting new requests")
        self._fault("generate")
        rid = message.rid
        self.running += 1
        self._running.add(rid)
        outputs = self._outputs(message)
        streamed = False
        try:
            async for output in outputs:
                self.last_output = time.monotonic()
                if not streamed:
                    streamed = True
                    self.streaming += 1
                error = self._handed_over.pop(rid, None) if output.finish_reason else None
                if error is not None and output.finish_reason == "cancelled":
                    # Our own abort for a drain: never let it look like a client cancel
                    # (Dynamo's PR #13952). Deliver its tokens, then the migratable error.
                    if output.token_ids:
                        yield EngineOutput(token_ids=output.token_ids)
                    raise error
                yield output
        finally:
            self.running -= 1
            self.streaming -= streamed
            self.finished += 1
            self._running.discard(rid)
            self._handed_over.pop(rid, None)
            # Closing the engine's stream early aborts the request (engines abort synchronously
            # in aclose, so this completes even under cancellation).
            aclose = getattr(outputs, "aclose", None)
            if aclose is not None:
                await aclose()
