"""Admission at the front door: whether new requests are taken, and how many are in flight."""

from __future__ import annotations

import anyio

from protocols.errors import WorkerDraining

__all__ = ["Admission"]


class Admission:
    """The root's admission gate. ``ready`` drives ``/health``; ``admitting`` new requests."""

    def __init__(self) -> None:
        self.ready = True
        self.admitting = True
        self.inflight = 0
        self._idle: list[anyio.Event] = []

    def enter(self) -> None:
        """Admit one request, or raise ``WorkerDraining`` (HTTP 503) when shutting down."""
        if not self.admitting:
            raise WorkerDraining("the server is shutting down and takes no new requests")
        self.inflight += 1

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            idle, self._idle = self._idle, []
            for event in idle:
                event.set()

    async def wait_idle(self) -> None:
        """Return once no request is in flight."""
        while self.inflight:
            event = anyio.Event()
            self._idle.append(event)
            await event.wait()
