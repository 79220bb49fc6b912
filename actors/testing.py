"""Helpers for testing code built on the actor runtime, on asyncio and on trio.

:func:`wait_until` polls state that has nothing to wait on (another task's counters, another
process's tables). :func:`crash`, :func:`exit_with` and :func:`hang` inject faults into any local
actor a test owns, without the actor's help: the fault is queued in the actor's mailbox like a
message and runs in its message loop in place of a handler, so it happens after the messages
already queued, exactly as a handler that raised, stopped or blocked would. For a process actor
they act on its side in this process (the proxy that owns the OS process). :class:`VirtualClock`
drives restart intensity and backoff without real sleeping.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel

from actors._clock import VirtualClock
from actors._errors import ActorNotRunning
from actors._exit import ExitReason
from actors._mailbox import INJECTED
from actors._ref import ActorRef, Down, Monitor
from actors._runtime import Incarnation

__all__ = [
    "InjectedCrash",
    "VirtualClock",
    "WaitTimeout",
    "crash",
    "exit_with",
    "hang",
    "wait_until",
]

Predicate = Callable[[], bool | Awaitable[bool]]

# Zero-length yields first: most conditions a test waits for are one or two task switches away.
_SPINS = 100
# Then naps from a millisecond, growing slowly, for state that moves with another process.
_FIRST_NAP = 0.001
_NAP_GROWTH = 1.25
_LONGEST_NAP = 0.02


class WaitTimeout(TimeoutError):
    """:func:`wait_until`'s condition did not hold within its timeout."""


class InjectedCrash(Exception):
    """The error :func:`crash` raises in an actor when the test names none."""


async def wait_until(predicate: Predicate, *, timeout: float = 10.0) -> None:
    """Let the other tasks run until ``predicate()`` is true (a plain or an async function).

    ``timeout`` is a guard in wall-clock seconds, not a timing assertion: it turns a hang into a
    :class:`WaitTimeout` naming the predicate. Wall-clock, so a virtual or mock clock cannot end
    it early.
    """
    deadline = time.monotonic() + timeout
    spins = 0
    nap = _FIRST_NAP
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
            spins = _SPINS  # it may do real work (an ask to another process): pace it with naps
        if result:
            return
        if time.monotonic() > deadline:
            raise WaitTimeout(f"{_describe(predicate)} still false after {timeout} s")
        if spins < _SPINS:
            spins += 1
            await anyio.lowlevel.checkpoint()
        else:
            await anyio.sleep(nap)
            nap = min(nap * _NAP_GROWTH, _LONGEST_NAP)


def _describe(predicate: Predicate) -> str:
    """The predicate's name, with where it was defined (a lambda's name alone says nothing)."""
    name = getattr(predicate, "__qualname__", None) or repr(predicate)
    code = getattr(predicate, "__code__", None)
    if code is None:
        return f"condition {name}"
    return f"condition {name} ({code.co_filename}:{code.co_firstlineno})"


def _incarnation(ref: ActorRef[Any]) -> Incarnation:
    runtime = ref._cell.runtime
    if runtime is None:
        raise ref._cell.not_running_error()
    return runtime


def _inject(ref: ActorRef[Any], fault: Callable[[], Awaitable[None]]) -> Monitor:
    """Queue ``fault`` for the message loop of ``ref``'s current incarnation; return a monitor
    on that incarnation."""
    runtime = _incarnation(ref)
    monitor = ref.monitor()
    # Into the incarnation's own mailbox, regardless of capacity: a process actor's ref leads to
    # its OS process, where a callable cannot go.
    runtime.mailbox.put_system((INJECTED, fault, None))
    return monitor


async def crash(ref: ActorRef[Any], error: Exception | None = None) -> Down:
    """Make ``ref``'s incarnation crash with ``error`` as if a handler raised it; return its Down.

    Its ``stopping`` hook runs and its supervisor sees an abnormal exit whose reason carries
    ``error`` (an :class:`InjectedCrash` by default). An actor blocked in a handler reaches the
    fault only once that handler returns.
    """
    raised = error if error is not None else InjectedCrash(f"{ref.name} crashed (injected)")

    async def fault() -> None:
        raise raised

    return await _inject(ref, fault).wait()


async def exit_with(ref: ActorRef[Any], reason: ExitReason) -> Down:
    """Make ``ref``'s incarnation stop by itself with ``reason``, as ``Actor.stop(reason)`` in a
    handler would (gracefully: its ``stopping`` hook runs); return its Down."""
    runtime = _incarnation(ref)

    async def fault() -> None:
        runtime.request_stop(reason)

    return await _inject(ref, fault).wait()


async def hang(ref: ActorRef[Any]) -> None:
    """Block ``ref``'s message loop for good, as a handler that never returns; return once it
    is blocked.

    Nothing it is sent is handled any more, and a graceful stop cannot reach it: only a kill
    (its supervisor's shutdown timeout, a brutal kill, a linked exit) ends it. Raises
    :class:`~actors.ActorNotRunning` if the incarnation ends before it gets stuck.
    """
    entered = anyio.Event()

    async def fault() -> None:
        entered.set()
        await anyio.sleep_forever()

    monitor = _inject(ref, fault)
    ended: list[Down] = []
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            ended.append(await monitor.wait())
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        await entered.wait()
        tg.cancel_scope.cancel()
    monitor.cancel()
    if not entered.is_set():
        raise ActorNotRunning(ref.name, ended[0].reason if ended else None)
