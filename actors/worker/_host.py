"""The engine actor's body: owns one engine (mock, hf or sglang) and serves the contract.

It runs inside the engine's own OS process (a process actor), so a CUDA fault or an OOM kill
takes down only this process. It is the only caller of the engine's ``cleanup``.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from actors import Actor, ExitReason, ReplyError
from protocols import control as c
from protocols.engine import Engine, EngineOutput, PreprocessedRequest
from protocols.errors import RequestError

__all__ = ["EngineHost", "build_engine"]


def build_engine(backend: str, config: bytes, task_group: Any) -> Engine:
    """The engine for ``backend`` from its msgpack-encoded config."""
    if backend == "mock":
        from actors.engines import MockEngine, MockEngineConfig

        return MockEngine(
            msgspec.msgpack.decode(config, type=MockEngineConfig), task_group=task_group
        )
    if backend == "hf":
        from actors.engines._hf import HFEngine, HFEngineConfig

        return HFEngine(msgspec.msgpack.decode(config, type=HFEngineConfig))
    if backend == "sglang":
        from actors.engines._sglang import SGLangEngine

        options = msgspec.msgpack.decode(config)
        return SGLangEngine(options.pop("server_args"), **options)
    raise ValueError(f"unknown engine backend {backend!r} (mock, hf, sglang)")


class EngineHost(Actor):
    """Serves ``protocols.control`` messages and generation streams for one engine."""

    reply_errors = (RequestError,)

    def __init__(self, backend: str, config: bytes) -> None:
        self.backend = backend
        self.config = config
        self.engine: Engine | None = None
        self.running = 0
        self.finished = 0
        self.last_output = time.monotonic()
        self._capacity: Any = None

    async def started(self) -> None:
        self.engine = build_engine(self.backend, self.config, self.task_group)
        try:
            self._capacity = await self.engine.start()
        except BaseException:
            await self.engine.cleanup()
            raise

    async def stopping(self, reason: ExitReason) -> None:
        if self.engine is not None:
            await self.engine.cleanup()

    async def receive(self, message: Any) -> Any:
        engine = self.engine
        assert engine is not None
        match message:
            case c.GetCapacity():
                return self._capacity
            case c.Abort(rid=rid):
                await engine.abort(rid)
            case c.Pause(mode=mode):
                await engine.pause(mode)
            case c.ContinueGeneration():
                await engine.continue_generation()
            case c.ReleaseMemory(tags=tags):
                await engine.release_memory(tags)
            case c.ResumeMemory(tags=tags):
                await engine.resume_memory(tags)
            case c.FlushCache():
                return await engine.flush_cache()
            case c.IsQuiescent():
                return engine.is_quiescent()
            case c.WaitQuiescent():
                waiter = getattr(engine, "wait_quiescent", None)
                if waiter is None:
                    raise ReplyError("this engine cannot wait for quiescence")
                await waiter()
            case c.GetHealthPayload():
                return engine.health_payload()
            case c.GetStats():
                released = getattr(engine, "released_tags", ())
                native = engine.statistics() if hasattr(engine, "statistics") else None
                return c.EngineStats(
                    running=self.running,
                    finished=self.finished,
                    last_output=self.last_output,
                    released=tuple(released() if callable(released) else released),
                    quiescent=engine.is_quiescent(),
                    kv_used_blocks=getattr(native, "used_blocks", -1),
                    engine_in_flight=getattr(native, "in_flight", -1),
                    pid=os.getpid(),
                )
            case _:
                return await super().receive(message)
        return None

    async def receive_stream(self, message: Any) -> AsyncIterator[EngineOutput]:
        if not isinstance(message, PreprocessedRequest):
            raise ReplyError(f"expected a PreprocessedRequest, got {type(message).__name__}")
        assert self.engine is not None
        self.running += 1
        outputs = self.engine.generate(message)
        try:
            async for output in outputs:
                self.last_output = time.monotonic()
                yield output
        finally:
            self.running -= 1
            self.finished += 1
            # Closing the engine's stream early aborts the request (engines abort synchronously
            # in aclose, so this completes even under cancellation).
            aclose = getattr(outputs, "aclose", None)
            if aclose is not None:
                await aclose()
