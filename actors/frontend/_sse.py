"""The SSE response: sse-starlette's, minus its uvicorn-specific shutdown watcher."""

from __future__ import annotations

import anyio
from sse_starlette import EventSourceResponse

__all__ = ["SSEResponse"]


class SSEResponse(EventSourceResponse):
    """sse-starlette's ``EventSourceResponse`` (disconnect detection, keep-alive pings, closing the
    body iterator when a send fails), without its server-exit watcher.

    That watcher looks for uvicorn's exit flag from a task started with ``asyncio`` directly: on
    asyncio the task outlives the request (a leak our structured-concurrency rule forbids), and
    under trio it cannot start at all. We serve with hypercorn, whose graceful shutdown already
    lets in-flight streams finish and then cancels them, so the stream simply never looks.
    """

    @staticmethod
    async def _listen_for_exit_signal() -> None:
        await anyio.sleep_forever()
