"""The engine actor's body: owns one engine (any backend of the table) and serves the contract.

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
import structlog

from actors import Actor, ExitReason, ReplyError
from actors.serving.errors import InjectedCrash
from actors.serving.worker._backends import engine_backend
from actors.serving.worker._faults import InjectedFaults, SlowDown
from actors.serving.worker._kvbridge import KVBridge, needs_transfer
from protocols import control as c
from protocols.engine import (
    Capacity,
    Engine,
    EngineOutput,
    MemoryTag,
    OutputStream,
    PauseMode,
    PreprocessedRequest,
)
from protocols.errors import EngineShutdown, RequestError, WorkerDraining

__all__ = ["EngineHost", "InjectedCrash"]

_log = structlog.get_logger("actorserve.worker")


class EngineHost(Actor):
    """Serves ``protocols.control`` messages and generation streams for one engine.

    ``backend`` names the engine's entry in the backend table (``UnknownBackend`` otherwise),
    and ``config`` is what that entry's ``configure`` made in the root.
    """

    reply_errors = (RequestError,)

    def __init__(self, backend: str, config: bytes, worker_id: str = "") -> None:
        self.backend = engine_backend(backend)
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
        self._capacity: Capacity | None = None
        self.admitting = True
        self.paused = False  # generation paused by the lifecycle (a release, a drain)
        self._running: set[str] = set()
        # A drained request's end (the migratable error its stream raises), from the drain on.
        self._handed_over: dict[str, RequestError] = {}
        self._handovers = {"live": 0, "replay": 0}
        self.faults = InjectedFaults()  # control.InjectFault's (tests, scenarios)

    async def started(self) -> None:
        self.engine = self.backend.build(self.config, self.task_group)
        try:
            self._capacity = await self.engine.start()
            await self._open_bridge()
        except BaseException:
            await self._close_bridge()
            await self.engine.cleanup()
            raise
        # In the engine's own process: its pid ties the worker to what ps and the kernel say.
        _log.info("engine started", worker=self.worker_id, role=self.engine.role, pid=os.getpid())

    async def stopping(self, reason: ExitReason) -> None:
        await self._close_bridge()
        if self.engine is not None:
            await self.engine.cleanup()

    async def _open_bridge(self) -> None:
        """Our KV transfer, for a prefill or decode engine that does not move KV itself."""
        engine, transfer = self.engine, self.backend.kv_transfer
        assert engine is not None
        if transfer is None or engine.role == "aggregated" or self.bridge is not None:
            return
        bridge = KVBridge(transfer(engine, self.faults), engine.role, self.worker_id)
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
        faults = self.faults
        match message:
            case c.GetCapacity():
                return (
                    self.bridge.capacity(self._capacity)
                    if self.bridge is not None and self._capacity is not None
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
                if faults.armed:
                    faults.check("pause")
                await engine.pause(mode)
                self.paused = True
            case c.ContinueGeneration():
                await engine.continue_generation()
                self.paused = False
            case c.ReleaseMemory(tags=tags):
                if faults.armed:
                    faults.check("release_memory")
                if MemoryTag.KV_CACHE in tags:
                    await self._close_bridge()  # the registered KV buffer is about to go
                await engine.release_memory(tags)
            case c.ResumeMemory(tags=tags):
                if faults.armed:
                    faults.check("resume_memory")
                await engine.resume_memory(tags)
                if MemoryTag.KV_CACHE in tags:
                    await self._open_bridge()  # a new buffer: register it again
            case c.Drain(handover=handover, shutdown=shutdown, live=live):
                await self._drain(handover, shutdown, live and not shutdown)
            case c.Undrain(continue_generation=continue_generation):
                if continue_generation:
                    await engine.continue_generation()
                    self.paused = False
                self.admitting = True
            case c.InjectFault(operation=operation, count=count):
                faults.add(operation, count)
            case c.FlushCache():
                return await engine.flush_cache()
            case c.IsQuiescent():
                return engine.is_quiescent()
            case c.GetHealthPayload():
                if faults.armed:
                    faults.check("health")
                return engine.health_payload()
            case c.Perturb(action=action, factor=factor):
                await self._perturb(action, factor)
            case c.GetStats():
                return self._stats(engine)
            case _:
                return await super().receive(message)
        return None

    def _stats(self, engine: Engine) -> c.EngineStats:
        native = engine.statistics()
        bridge = self.bridge
        return c.EngineStats(
            running=self.running,
            streaming=self.streaming,
            finished=self.finished,
            last_output=self.last_output,
            released=tuple(native.released),
            quiescent=engine.is_quiescent(),
            kv_used_blocks=native.used_blocks,
            engine_in_flight=native.in_flight,
            pid=os.getpid(),
            admitting=self.admitting,
            paused=self.paused,
            prefill_tokens=native.prefill_tokens,
            kv_received_tokens=native.kv_received_tokens,
            handovers_live=self._handovers["live"],
            handovers_replay=self._handovers["replay"],
            handovers_open=bridge.handovers_open if bridge else 0,
            kv_write_seconds=bridge.write_seconds() if bridge else 0.0,
            transfer_pages=bridge.transfer_pages() if bridge else 0,
            counters=_figures(native, "counters"),
            histograms=_figures(native, "histograms"),
        )

    async def _perturb(self, action: str, factor: float) -> None:
        """Fault injection (scenarios): see ``protocols.control.Perturb``."""
        engine = self.engine
        assert engine is not None
        if action == "crash":
            # Not a reply error: it escapes the handler and crashes this actor.
            raise InjectedCrash("injected crash of the engine actor's handler")
        if action == "hang":
            # Straight to the engine, not through our own pause bookkeeping: from the outside
            # this must look like an engine that stopped making progress, nothing else.
            await engine.pause(PauseMode.IN_PLACE)
        elif action == "unhang":
            await engine.continue_generation()
        elif action == "slow" and isinstance(engine, SlowDown):
            engine.slow_down(factor)
        else:
            raise ReplyError(f"cannot perturb a {self.backend.name} engine with {action!r}")

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

    def _outputs(self, request: PreprocessedRequest) -> OutputStream:
        assert self.engine is not None
        bridge = self.bridge
        if bridge is not None and needs_transfer(request):
            if bridge.role == "prefill":
                return bridge.prefill(request)
            return bridge.decode(request)
        return self.engine.generate(request)

    async def receive_stream(self, message: Any) -> AsyncIterator[EngineOutput]:
        assert self.engine is not None
        if isinstance(message, c.WaitQuiescent):
            # A stream, not an ask: a drain may take long, and the mailbox must keep serving
            # meanwhile (aborts of handed-over requests, health checks, statistics).
            await self.engine.wait_quiescent()
            return
        if not isinstance(message, PreprocessedRequest):
            raise ReplyError(f"expected a PreprocessedRequest, got {type(message).__name__}")
        if not self.admitting and not message.health_check:
            raise WorkerDraining("the worker is not accepting new requests")
        if self.faults.armed:
            self.faults.check("generate")
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
            await outputs.aclose()


def _figures(stats: object, kind: str) -> dict[str, Any]:
    """A snapshot's own ``counters()`` or ``histograms()``, which only some engines keep."""
    figures = getattr(stats, kind, None)
    return dict(figures()) if callable(figures) else {}
