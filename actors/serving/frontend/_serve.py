"""Serve an ASGI app on the running anyio backend: uvicorn (httptools) on asyncio, hypercorn on
trio.

Two servers because neither does both well: uvicorn runs on asyncio only, and hypercorn's
pure-Python HTTP/1.1 (h11) cost more CPU per request (about 0.5 ms, measured) and per chunk
(about 15 us) than all of the frontend's own work. Both get the same pre-bound socket and the
same graceful shutdown: stop accepting, let in-flight requests finish for the grace period,
then cancel them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import cast

import anyio
from anyio.abc import TaskStatus
from hypercorn.config import Config, Sockets
from hypercorn.typing import ASGIFramework
from hypercorn.utils import wrap_app
from starlette.types import ASGIApp

__all__ = ["serve"]

log = logging.getLogger("actorserve.frontend.http")


def _listen(host: str, port: int, backlog: int) -> socket.socket:
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on accepted sockets whose proto
    # says TCP, and socket.create_server leaves it 0. Without it, a response written in two
    # pieces (headers, then body) waits ~40 ms for the client's delayed ACK (Nagle).
    family, type_, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _on_trio() -> bool:
    try:
        import sniffio
    except ImportError:
        return False  # trio depends on sniffio: without it, this is asyncio (as anyio assumes)
    return sniffio.current_async_library() == "trio"


def _hypercorn_config(graceful_timeout_s: float, keep_alive_timeout_s: float) -> Config:
    config = Config()
    config.graceful_timeout = graceful_timeout_s
    config.keep_alive_timeout = keep_alive_timeout_s
    config.accesslog = None  # an access log line per request costs more than the request path
    config.errorlog = log
    return config


async def _hypercorn(
    app: ASGIApp,
    sock: socket.socket,
    stop: anyio.Event,
    graceful_timeout_s: float,
    keep_alive_timeout_s: float,
    backlog: int,
) -> None:
    from hypercorn.trio.run import worker_serve

    config = _hypercorn_config(graceful_timeout_s, keep_alive_timeout_s)
    config.backlog = backlog
    sockets = Sockets(secure_sockets=[], insecure_sockets=[sock], quic_sockets=[])
    # Starlette's and hypercorn's ASGI type aliases describe the same callable differently.
    wrapped = wrap_app(cast(ASGIFramework, app), config.wsgi_max_body_size, "asgi")
    # worker_serve takes ready-made sockets (the public serve() only bind strings), which is
    # how serve() knows its port before anything connects.
    await worker_serve(wrapped, config, sockets=sockets, shutdown_trigger=stop.wait)


async def _uvicorn(
    app: ASGIApp,
    sock: socket.socket,
    stop: anyio.Event,
    graceful_timeout_s: float,
    keep_alive_timeout_s: float,
    backlog: int,
) -> None:
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield  # the process's signals are its owner's (the root's staged shutdown), not ours

    config = uvicorn.Config(
        app,
        http="httptools",
        ws="none",
        lifespan="off",
        interface="asgi3",
        log_config=None,
        access_log=False,  # a log line per request costs more than the request path
        proxy_headers=False,  # no proxy is trusted: no per-request header rewriting
        server_header=False,
        backlog=backlog,
        # uvicorn counts both in whole seconds.
        timeout_keep_alive=math.ceil(keep_alive_timeout_s),
        timeout_graceful_shutdown=math.ceil(graceful_timeout_s),
    )
    server = Server(config)

    async def trigger() -> None:
        await stop.wait()
        server.should_exit = True  # uvicorn looks at it every 0.1 s

    async with anyio.create_task_group() as tg:
        tg.start_soon(trigger)
        await server.serve(sockets=[sock])
        tg.cancel_scope.cancel()
    # Past the grace period uvicorn cancels the requests' tasks without waiting for them: wait
    # here, so none outlives serve().
    if server.server_state.tasks:
        await asyncio.wait(set(server.server_state.tasks))


Runner = Callable[[ASGIApp, socket.socket, anyio.Event, float, float, int], Awaitable[None]]


async def serve(
    app: ASGIApp,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    graceful_timeout_s: float = 5.0,
    keep_alive_timeout_s: float = 5.0,
    backlog: int = 1024,
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` over HTTP on ``host:port`` until cancelled, then shut down gracefully.

    Binds before reporting: ``task_status.started(port)`` gives the bound port (useful with
    ``port=0``), so ``await tg.start(serve, app)`` returns once connections are accepted.
    Cancellation stops accepting connections, lets in-flight requests finish for up to
    ``graceful_timeout_s``, then cancels what is left and returns (re-raising the cancellation).
    """
    sock = _listen(host, port, backlog)
    with sock:
        bound_port: int = sock.getsockname()[1]
        runner: Runner = _hypercorn if _on_trio() else _uvicorn
        stop = anyio.Event()
        stopped = anyio.Event()
        # The server runs shielded: cancelling serve() must become its own graceful shutdown,
        # not a cancellation that cuts every connection at once.
        shield = anyio.CancelScope(shield=True)

        async def run() -> None:
            try:
                with shield:
                    await runner(app, sock, stop, graceful_timeout_s, keep_alive_timeout_s, backlog)
            finally:
                stopped.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            task_status.started(bound_port)
            try:
                await stopped.wait()  # the server only returns early if it failed
            finally:
                stop.set()
                # The server bounds the drain by the grace period; the margin is for its own
                # shutdown. Past it, cancel whatever is still running.
                with anyio.move_on_after(graceful_timeout_s + 2.0, shield=True):
                    await stopped.wait()
                shield.cancel()
