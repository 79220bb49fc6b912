"""When an ``hf`` engine is quiescent: ``HFEngine`` and ``HFEmbeddingEngine`` both keep the
requests they still owe an ending in ``_live`` (on the event loop)."""

from __future__ import annotations

from collections.abc import Sized

import anyio

__all__ = ["LiveRequests"]


class LiveRequests:
    """``is_quiescent`` / ``wait_quiescent`` over ``_live``: the engine calls :meth:`_settle`
    after it lets go of a request."""

    _live: Sized  # the requests still owed an ending (the engine's own collection)
    _quiet: anyio.Event | None = None  # set when the last live request lets go

    def is_quiescent(self) -> bool:
        """True when no request is queued, running, or owed its ending."""
        return not self._live

    async def wait_quiescent(self) -> None:
        """Wait until :meth:`is_quiescent` (e.g. a drain after ``abort`` or closed streams)."""
        while self._live:
            if self._quiet is None or self._quiet.is_set():
                self._quiet = anyio.Event()
            await self._quiet.wait()

    def _settle(self) -> None:
        """On the loop, after a request let go: wake ``wait_quiescent`` once none is left."""
        if not self._live and self._quiet is not None:
            self._quiet.set()
