"""The SSE response: sse-starlette's, with a status line chosen by the stream's first item."""

from __future__ import annotations

from typing import Any, cast

import anyio
from sse_starlette import EventSourceResponse
from starlette.responses import Response
from starlette.types import Message, Send

__all__ = ["SSEResponse"]


class SSEResponse(EventSourceResponse):
    """sse-starlette's ``EventSourceResponse`` (disconnect detection, keep-alive pings, closing the
    body iterator when a send fails) with three changes.

    The body iterator's first item is the *head*: ``None`` means "stream", a Starlette
    ``Response`` is sent instead of the stream (an error found before the first chunk keeps its
    own status code). The head is awaited inside the response's task group, so a client that
    leaves while it is awaited cancels it like any other part of the stream, and the whole stream
    is consumed by one task. Keep-alive pings wait until the status line is out.

    No server-exit watcher: sse-starlette's looks for uvicorn's exit flag from a task started with
    ``asyncio`` directly, which outlives the request on asyncio (a leak our structured-concurrency
    rule forbids) and cannot start under trio. Hypercorn's graceful shutdown already lets
    in-flight streams finish, then cancels them.

    No per-send cancel scope when there is no send timeout (ours): entering and leaving an anyio
    cancel scope for every chunk cost more than the rest of our per-chunk work.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_sent = anyio.Event()

    async def _stream_response(self, send: Send) -> None:
        body = cast(Any, self.body_iterator)
        head = await body.__anext__()
        if isinstance(head, Response):
            try:
                start = {"type": "http.response.start", "status": head.status_code}
                await send({**start, "headers": head.raw_headers})
                await send({"type": "http.response.body", "body": head.body, "more_body": False})
            finally:
                await body.aclose()
            return
        self._head_sent.set()
        await super()._stream_response(send)

    async def _ping(self, send: Send) -> None:
        await self._head_sent.wait()
        await super()._ping(send)

    @staticmethod
    async def _listen_for_exit_signal() -> None:
        await anyio.sleep_forever()

    async def _send_with_timeout(self, send: Send, message: Message) -> None:
        if self.send_timeout is None:
            await send(message)
        else:
            await super()._send_with_timeout(send, message)
