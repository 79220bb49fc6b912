"""Per-event-loop implementations of the hot path's wake-ups, and the loop a process runs on.

:func:`backend` picks the implementation for the running loop (asyncio, uvloop's asyncio, or
trio); the trio one is imported on first use so asyncio programs never import trio.
"""

from actors._backends._asyncio import Backend, Parking, Reply, backend
from actors._backends._loops import default_loop, run_on

__all__ = ["Backend", "Parking", "Reply", "backend", "default_loop", "run_on"]
