"""The step thread: owns the batching core, runs commands and steps, hands results to the loop.

torch releases the GIL inside its kernels, so a dedicated thread keeps the event loop free
while a step runs (tens to hundreds of milliseconds on a CPU). The core is single-threaded: the
async side never touches it, it posts commands (plain callables) to the thread's inbox. The
thread sends what commands and steps produced back to the event loop with one non-blocking
``run_sync_soon`` per round (anyio's thread-safe call into asyncio or trio), so it never waits
for the loop and a busy or finished loop cannot stall it.

A plain thread rather than an ``anyio.to_thread`` task: the engine contract has no task group to
host a long-lived task (``start`` returns while stepping goes on), and a step loop must keep
running regardless of how fast any one consumer reads. ``stop`` joins it; the thread is a daemon
only so that an engine never cleaned up cannot hang interpreter exit.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import anyio
import anyio.lowlevel

from protocols.errors import EngineFailure

from ._batch import BatchCore, Delivery

__all__ = ["Command", "Reply", "StepRunner"]

T = TypeVar("T")


class Reply(Generic[T]):
    """The loop-side end of one command: set on the event loop thread, awaited there."""

    def __init__(self) -> None:
        self._event = anyio.Event()
        self._value: T | None = None
        self._error: BaseException | None = None

    def resolve(self, value: T | None, error: BaseException | None) -> None:
        """Called on the event loop thread."""
        self._value, self._error = value, error
        self._event.set()

    async def wait(self) -> T:
        """The command's result, or its exception re-raised."""
        await self._event.wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


Command = Callable[[BatchCore, list[Delivery]], T]
"""A command runs on the step thread with the core and a list to append stream items to."""
_Queued = tuple[Command[Any], Reply[Any] | None]


class StepRunner:
    """Runs ``init`` then serves commands and steps on one thread until ``stop``."""

    def __init__(
        self,
        init: Callable[[], BatchCore],
        on_round: Callable[[list[Delivery]], None],
        *,
        on_idle: Callable[[BatchCore], None] | None = None,
        name: str = "hf-engine-step",
    ) -> None:
        self._init = init
        self._on_round = on_round  # called on the loop thread with every round's deliveries
        self._on_idle = on_idle  # called on the step thread after every round
        self._token = anyio.lowlevel.current_token()
        self._cv = threading.Condition()
        self._inbox: deque[_Queued] = deque()
        self._stopping = False
        self._ready: Reply[None] = Reply()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    async def start(self) -> None:
        """Start the thread and wait for ``init`` (raising what it raised)."""
        self._thread.start()
        await self._ready.wait()

    def post(self, fn: Command[Any], reply: Reply[Any] | None = None) -> None:
        """Queue a command without waiting for it; ``reply`` (if any) gets its result."""
        with self._cv:
            self._inbox.append((fn, reply))
            self._cv.notify()

    async def call(self, fn: Command[T]) -> T:
        """Run ``fn`` on the step thread and return its result."""
        reply: Reply[T] = Reply()
        self.post(fn, reply)
        return await reply.wait()

    async def stop(self, final: Command[Any]) -> None:
        """Run ``final`` as the last command, end the thread and join it (off the loop)."""
        if not self._thread.is_alive():
            return
        with self._cv:
            self._inbox.append((final, None))
            self._stopping = True
            self._cv.notify()
        await anyio.to_thread.run_sync(self._thread.join)

    # ---- the thread ------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            core = self._init()
        except BaseException as exc:
            self._send([], [(self._ready, None, exc)])
            return
        self._send([], [(self._ready, None, None)])
        self._serve(core)

    def _serve(self, core: BatchCore) -> None:
        while True:
            with self._cv:
                while not self._inbox and not self._stopping and not core.can_step:
                    self._cv.wait()
                commands = list(self._inbox)
                self._inbox.clear()
                stopping = self._stopping
            deliveries: list[Delivery] = []
            replies: list[tuple[Reply[Any], Any, BaseException | None]] = []
            for fn, reply in commands:
                try:
                    result = fn(core, deliveries)
                except Exception as exc:
                    if reply is not None:
                        replies.append((reply, None, exc))
                    continue
                if reply is not None:
                    replies.append((reply, result, None))
            if not stopping and core.can_step:
                try:
                    deliveries.extend(core.step())
                except Exception as exc:  # a bug, not a request's fault: nobody may hang on it
                    err = EngineFailure(f"engine step failed: {type(exc).__name__}: {exc}")
                    deliveries.extend(core.fail_all(err))
            if self._on_idle is not None:
                self._on_idle(core)
            if deliveries or replies:
                self._send(deliveries, replies)
            if stopping:
                return

    def _send(
        self,
        deliveries: list[Delivery],
        replies: list[tuple[Reply[Any], Any, BaseException | None]],
    ) -> None:
        def on_loop() -> None:
            if deliveries:
                self._on_round(deliveries)
            for reply, value, error in replies:
                reply.resolve(value, error)

        # EventLoopToken.backend_class.run_sync_soon: anyio's non-blocking, thread-safe call
        # into the loop (asyncio call_soon_threadsafe / trio TrioToken.run_sync_soon).
        try:
            self._token.backend_class.run_sync_soon(on_loop, (), self._token.native_token)
        except Exception:  # the event loop is gone: nobody is left to read the results
            pass
