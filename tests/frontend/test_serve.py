"""Serving (uvicorn on asyncio, hypercorn on trio): ephemeral loopback ports, graceful shutdown."""

from __future__ import annotations

import anyio
import httpx
import pytest
from anyio.abc import TaskStatus
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from actors.serving.frontend import create_app, serve
from tests.frontend._doubles import ANSWER, FakeBackend
from tests.frontend._http import CHAT, chat_body, chunks, open_raw_stream, read_until


async def test_serve_binds_loopback_and_reports_its_port(app: FastAPI) -> None:
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve, app, "127.0.0.1", 0)
        assert isinstance(port, int) and port > 0
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert (await client.get("/live")).status_code == 200
        tg.cancel_scope.cancel()


async def test_a_port_in_use_fails_at_start(app: FastAPI) -> None:
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve, app, "127.0.0.1", 0)
        with pytest.raises(OSError):
            await tg.start(serve, app, "127.0.0.1", port)
        tg.cancel_scope.cancel()


async def test_cancel_lets_an_inflight_stream_finish(backend: FakeBackend) -> None:
    backend.delay = 0.01  # the stream lasts a while after the cancel
    app = create_app(backend, CollectorRegistry())
    server = anyio.CancelScope()

    async def run(*, task_status: TaskStatus[int]) -> None:
        with server:
            await serve(app, "127.0.0.1", 0, graceful_timeout_s=10, task_status=task_status)

    async with anyio.create_task_group() as tg:
        port = await tg.start(run)
        async with (
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
            client.stream("POST", CHAT, json=chat_body(stream=True)) as response,
        ):
            pieces = response.aiter_text()
            body = await anext(pieces)
            server.cancel()  # graceful shutdown starts now, mid-stream
            body += "".join([piece async for piece in pieces])
    # Every chunk arrived: the drained stream is complete.
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks(body))
    assert text == ANSWER
    assert backend.completed == [backend.requests[0].rid]
    # And the server is gone.
    with pytest.raises(OSError):
        await anyio.connect_tcp("127.0.0.1", port)


async def test_shutdown_cancels_streams_that_outlast_the_grace_period(
    backend: FakeBackend,
) -> None:
    backend.hang_after = 2
    app = create_app(backend, CollectorRegistry())
    server = anyio.CancelScope()

    async def run(*, task_status: TaskStatus[int]) -> None:
        with server:
            await serve(app, "127.0.0.1", 0, graceful_timeout_s=0.2, task_status=task_status)

    async with anyio.create_task_group() as tg:
        port = await tg.start(run)
        conn = await open_raw_stream(f"http://127.0.0.1:{port}", CHAT, chat_body(stream=True))
        async with conn:
            await read_until(conn, b"data:")
            server.cancel()
            with anyio.fail_after(10):
                await backend.cancel_seen.wait()
    assert backend.cancelled == [backend.requests[0].rid]
