"""Serve an ASGI app with hypercorn on the running anyio backend (asyncio or trio)."""

from __future__ import annotations

import logging
import socket
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


def _config(graceful_timeout_s: float, keep_alive_timeout_s: float) -> Config:
    config = Config()
    config.graceful_timeout = graceful_timeout_s
    config.keep_alive_timeout = keep_alive_timeout_s
    config.accesslog = None  # an access log line per request costs more than the request path
    config.errorlog = log
    return config


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
        config = _config(graceful_timeout_s, keep_alive_timeout_s)
        config.backlog = backlog
        sockets = Sockets(secure_sockets=[], insecure_sockets=[sock], quic_sockets=[])
        # Starlette's and hypercorn's ASGI type aliases describe the same callable differently.
        wrapped = wrap_app(cast(ASGIFramework, app), config.wsgi_max_body_size, "asgi")
        stop = anyio.Event()
        stopped = anyio.Event()
        # Hypercorn runs shielded: cancelling serve() must become hypercorn's own graceful
        # shutdown (its shutdown trigger), not a cancellation that cuts every connection at once.
        shield = anyio.CancelScope(shield=True)

        async def run() -> None:
            try:
                with shield:
                    # worker_serve takes ready-made sockets (the public serve() only bind
                    # strings), which is how serve() knows its port before anything connects.
                    if _on_trio():
                        from hypercorn.trio.run import worker_serve as trio_serve

                        await trio_serve(
                            wrapped, config, sockets=sockets, shutdown_trigger=stop.wait
                        )
                    else:
                        from hypercorn.asyncio.run import worker_serve as asyncio_serve

                        await asyncio_serve(
                            wrapped, config, sockets=sockets, shutdown_trigger=stop.wait
                        )
            finally:
                stopped.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            task_status.started(bound_port)
            try:
                await stopped.wait()  # hypercorn only returns early if it failed
            finally:
                stop.set()
                # Hypercorn bounds the drain by graceful_timeout; the margin is for its lifespan
                # shutdown. Past it, cancel whatever is still running.
                with anyio.move_on_after(graceful_timeout_s + 2.0, shield=True):
                    await stopped.wait()
                shield.cancel()
