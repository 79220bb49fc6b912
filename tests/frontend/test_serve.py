"""Serving (uvicorn on asyncio, hypercorn on trio): ephemeral loopback ports, graceful shutdown."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest
from anyio.abc import TaskStatus
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from actors.serving.frontend import create_app, serve
from actors.serving.testing import ANSWER, FakeBackend
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


async def _closed_by_server(stream: anyio.abc.ByteStream) -> bool:
    """Whether the server closes ``stream`` (rather than answering) within the guard."""
    with anyio.fail_after(15):
        try:
            while await stream.receive():
                return False  # an answer: not what a half-sent request gets
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            return True
    return True


def _server(app: FastAPI, header_timeout_s: float, max_connections: int) -> Any:
    async def run(*, task_status: TaskStatus[int]) -> None:
        await serve(
            app,
            "127.0.0.1",
            0,
            header_timeout_s=header_timeout_s,
            keep_alive_timeout_s=header_timeout_s,
            max_connections=max_connections,
            task_status=task_status,
        )

    return run


async def test_a_client_cannot_hold_the_server_with_silent_or_slow_connections(
    app: FastAPI,
) -> None:
    async with anyio.create_task_group() as tg:
        port = await tg.start(_server(app, 0.5, 64))
        silent = await anyio.connect_tcp("127.0.0.1", port)
        slow = await anyio.connect_tcp("127.0.0.1", port)
        await slow.send(b"GET /live HTTP/1.1\r\nhost: x\r\n")  # and the rest never comes
        async with silent, slow:
            assert await _closed_by_server(silent)
            assert await _closed_by_server(slow)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert (await client.get("/live")).status_code == 200  # and it still serves
        tg.cancel_scope.cancel()


# uvicorn, the server on asyncio, caps connections; hypercorn (on trio) has no cap of its own,
# and there the header deadline above is what frees idle sockets.
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_connections_past_the_cap_are_closed_as_they_come(app: FastAPI) -> None:
    async with anyio.create_task_group() as tg:
        port = await tg.start(_server(app, 60, 8))  # no deadline frees a socket meanwhile
        held = [await anyio.connect_tcp("127.0.0.1", port) for _ in range(8)]
        over = await anyio.connect_tcp("127.0.0.1", port)
        async with over:
            assert await _closed_by_server(over)
        for stream in held:
            await stream.aclose()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert (await client.get("/live")).status_code == 200
        tg.cancel_scope.cancel()
