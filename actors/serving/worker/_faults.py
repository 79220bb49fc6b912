"""Fault injection into an engine actor (tests and scenarios), through a seam that costs nothing
while no fault is injected.

``control.InjectFault`` arms :class:`InjectedFaults`: the next ``count`` calls of an operation
fail. Every place that can fail reads one flag, :attr:`InjectedFaults.armed`, and calls into the
faults only while it is set, so a worker with no fault injected makes no fault call on any
request's path. ``control.Perturb`` acts at once instead (see the engine host).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from protocols.errors import EngineFailure

__all__ = ["InjectedFaults", "SlowDown"]


@runtime_checkable
class SlowDown(Protocol):
    """An engine whose speed ``control.Perturb("slow")`` can change (the mock's timing model)."""

    def slow_down(self, factor: float) -> None: ...


class InjectedFaults:
    """The faults injected into one engine actor and not yet taken, per operation
    (``generate``, ``health``, ``pause``, ``release_memory``, ``resume_memory``; on a decode
    worker with our KV bridge, ``fail_kv`` and ``corrupt_kv``; on a prefill worker with it,
    ``hold_kv``)."""

    __slots__ = ("_left", "armed")

    def __init__(self) -> None:
        self._left: dict[str, int] = {}
        self.armed = False  # whether any is left: read before any other call, on every path

    def add(self, operation: str, count: int = 1) -> None:
        """The next ``count`` calls of ``operation`` fail."""
        self._left[operation] = self._left.get(operation, 0) + count
        self.armed = any(self._left.values())

    def take(self, operation: str) -> bool:
        """Whether this call of ``operation`` fails (it takes one injected fault)."""
        left = self._left.get(operation, 0)
        if not left:
            return False
        self._left[operation] = left - 1
        self.armed = any(self._left.values())
        return True

    def check(self, operation: str) -> None:
        """Raise ``EngineFailure`` if this call of ``operation`` fails."""
        if self.take(operation):
            raise EngineFailure(f"injected fault in {operation}")
