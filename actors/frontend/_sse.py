"""The SSE response: sse-starlette's, minus its uvicorn-specific shutdown watcher."""

from __future__ import annotations

import anyio
from sse_starlette import EventSourceResponse
from starlette.types import Message, Send

__all__ = ["SSEResponse"]


class SSEResponse(EventSourceResponse):
    """sse-starlette's ``EventSourceResponse`` (disconnect detection, keep-alive pings, closing the
    body iterator when a send fails), without its server-exit watcher.

    That watcher looks for uvicorn's exit flag from a task started with ``asyncio`` directly: on
    asyncio the task outlives the request (a leak our structured-concurrency rule forbids), and
    under trio it cannot start at all. We serve with hypercorn, whose graceful shutdown already
    lets in-flight streams finish and then cancels them, so the stream simply never looks.

    It also skips the per-send cancel scope when there is no send timeout (ours): entering and
    leaving an anyio cancel scope for every chunk cost more than the rest of our per-chunk work.
    """

    @staticmethod
    async def _listen_for_exit_signal() -> None:
        await anyio.sleep_forever()

    async def _send_with_timeout(self, send: Send, message: Message) -> None:
        if self.send_timeout is None:
            await send(message)
        else:
            await super()._send_with_timeout(send, message)
