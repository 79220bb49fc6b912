"""Serve an ASGI app on the running anyio backend: uvicorn (httptools) on asyncio, hypercorn on
trio.

Two servers because neither does both well: uvicorn runs on asyncio only, and hypercorn's
pure-Python HTTP/1.1 (h11) costs more CPU per request and per chunk than all of the frontend's
own work. Both get the same pre-bound socket and the same graceful shutdown: stop accepting, let
in-flight requests finish for the grace period, then cancel them.

Neither lets a client hold the server: a connection must send a request's headers within
``header_timeout_s`` (hypercorn: its keep-alive timeout, which runs until a request's headers are
in), an idle one is closed after ``keep_alive_timeout_s``, and on uvicorn connections past
``max_connections`` are closed as they come, so idle sockets cannot use up the process's
descriptors.

With :class:`TlsFiles` both serve HTTPS on the same socket (TLS 1.2 or later, as each server's
defaults have it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import resource
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterator
from typing import cast

import anyio
import attrs
from anyio.abc import TaskStatus
from hypercorn.config import Config, Sockets
from hypercorn.typing import ASGIFramework
from hypercorn.utils import wrap_app
from starlette.types import ASGIApp

__all__ = ["DEFAULT_HEADER_TIMEOUT_S", "TlsFiles", "serve"]

log = logging.getLogger("actorserve.frontend.http")

#: Seconds a connection has to send a request's headers.
DEFAULT_HEADER_TIMEOUT_S = 10.0


@attrs.frozen
class TlsFiles:
    """A PEM certificate (chain) and its private key, for HTTPS."""

    certfile: str
    keyfile: str

    def check(self) -> None:
        """Load the pair once, so that a bad one fails (``ValueError``) before anything starts
        rather than in the server."""
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                self.certfile, self.keyfile
            )
        except OSError as exc:  # ssl.SSLError too; neither names the files
            raise ValueError(
                f"TLS certificate {self.certfile} with key {self.keyfile}: {exc}"
            ) from None


def default_max_connections() -> int:
    """Half the descriptors the process may open: the rest stay for workers, KV and control."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(64, min(soft, 1 << 20) // 2)


def _guarded_protocol(header_timeout_s: float, max_connections: int) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with a deadline for each request's headers and a cap on
    connections."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class Guarded(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                log.warning("HTTP connection refused: %d open", len(self.connections) - 1)
                transport.abort()
                return
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()  # the next request on a kept-alive connection has its own deadline

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            self.transport.abort()

    return Guarded


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


def _hypercorn_config(
    graceful_timeout_s: float, keep_alive_timeout_s: float, header_timeout_s: float
) -> Config:
    config = Config()
    config.graceful_timeout = graceful_timeout_s
    # Hypercorn's idle timer runs from the connection's start until a request's headers are in,
    # so the shorter of the two bounds both the headers and an idle connection.
    config.keep_alive_timeout = min(keep_alive_timeout_s, header_timeout_s)
    config.accesslog = None  # an access log line per request costs more than the request path
    config.errorlog = log
    return config


async def _hypercorn(
    app: ASGIApp, sock: socket.socket, stop: anyio.Event, limits: _Limits, tls: TlsFiles | None
) -> None:
    from hypercorn.trio.run import worker_serve

    config = _hypercorn_config(
        limits.graceful_timeout_s, limits.keep_alive_timeout_s, limits.header_timeout_s
    )
    config.backlog = limits.backlog
    if tls is None:
        sockets = Sockets(secure_sockets=[], insecure_sockets=[sock], quic_sockets=[])
    else:
        config.certfile, config.keyfile = tls.certfile, tls.keyfile
        sockets = Sockets(secure_sockets=[sock], insecure_sockets=[], quic_sockets=[])
    # Starlette's and hypercorn's ASGI type aliases describe the same callable differently.
    wrapped = wrap_app(cast(ASGIFramework, app), config.wsgi_max_body_size, "asgi")
    # worker_serve takes ready-made sockets (the public serve() only bind strings), which is
    # how serve() knows its port before anything connects.
    await worker_serve(wrapped, config, sockets=sockets, shutdown_trigger=stop.wait)


async def _uvicorn(
    app: ASGIApp, sock: socket.socket, stop: anyio.Event, limits: _Limits, tls: TlsFiles | None
) -> None:
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield  # the process's signals are its owner's (the root's staged shutdown), not ours

    config = uvicorn.Config(
        app,
        http=_guarded_protocol(limits.header_timeout_s, limits.max_connections),
        ws="none",
        lifespan="off",
        interface="asgi3",
        log_config=None,
        access_log=False,  # a log line per request costs more than the request path
        proxy_headers=False,  # no proxy is trusted: no per-request header rewriting
        server_header=False,
        backlog=limits.backlog,
        # uvicorn counts both in whole seconds.
        timeout_keep_alive=math.ceil(limits.keep_alive_timeout_s),
        timeout_graceful_shutdown=math.ceil(limits.graceful_timeout_s),
        ssl_certfile=None if tls is None else tls.certfile,
        ssl_keyfile=None if tls is None else tls.keyfile,
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


@attrs.frozen
class _Limits:
    graceful_timeout_s: float
    keep_alive_timeout_s: float
    header_timeout_s: float
    max_connections: int
    backlog: int


Runner = Callable[[ASGIApp, socket.socket, anyio.Event, _Limits, TlsFiles | None], Awaitable[None]]


async def serve(
    app: ASGIApp,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    graceful_timeout_s: float = 5.0,
    keep_alive_timeout_s: float = 5.0,
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    max_connections: int | None = None,
    backlog: int = 1024,
    tls: TlsFiles | None = None,
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` over HTTP (HTTPS with ``tls``) on ``host:port`` until cancelled, then shut
    down gracefully.

    Binds before reporting: ``task_status.started(port)`` gives the bound port (useful with
    ``port=0``), so ``await tg.start(serve, app)`` returns once connections are accepted.
    Cancellation stops accepting connections, lets in-flight requests finish for up to
    ``graceful_timeout_s``, then cancels what is left and returns (re-raising the cancellation).
    ``max_connections`` defaults to :func:`default_max_connections`.
    """
    limits = _Limits(
        graceful_timeout_s,
        keep_alive_timeout_s,
        header_timeout_s,
        default_max_connections() if max_connections is None else max_connections,
        backlog,
    )
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
                    await runner(app, sock, stop, limits, tls)
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
