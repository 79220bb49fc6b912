"""A :class:`~actors.process._link.Link` over ZMQ (``ipc://`` files or ``tcp://127.0.0.1``).

Two sockets per side, one that only receives (PULL, bound by the parent) and one that only sends
(PUSH): a ZMQ send processes its socket's pending commands and so can consume the FD's wake-up
while a message waits, which forces a socket that does both to re-check ``EVENTS`` after every
send, on both sides of every round trip. A send-only socket has nothing to lose.

Each wake-up tries a receive at once (a wake-up almost always means a message) and reads until
``EVENTS`` shows none left, which re-arms the FD's edge. ZMQ reconnects on its own: a ZMQ link
never sees its peer close.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any

import zmq
from zmq.backend import Socket as _RawSocket

from actors._zmq import context
from actors.process._frames import message, parse
from actors.process._link import Link, LinkBroken, MessageHandler

__all__ = ["ZmqLink"]

_COPY_BELOW = 65536  # larger messages are sent without a copy
_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)
_NOBLOCK = int(zmq.NOBLOCK)
# The backend's methods, skipping pyzmq's pure-Python wrappers, which cost more than the send.
_send: Any = _RawSocket.send
_recv: Any = _RawSocket.recv
_get: Any = _RawSocket.get


class ZmqLink(Link):
    """A receiving and a sending ZMQ socket."""

    def __init__(self, on_message: MessageHandler, transport: str) -> None:
        super().__init__(on_message)
        self._transport = transport
        ctx = context()
        self._rx = ctx.socket(zmq.PULL)
        self._tx = ctx.socket(zmq.PUSH)
        for sock in (self._rx, self._tx):
            sock.setsockopt(zmq.LINGER, 0)
            # Flow control is the actors' job (credits, mailbox capacity): a send never blocks.
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        self._fd = int(self._rx.getsockopt(zmq.FD))
        self._files: list[str] = []  # ipc socket files we bound (ZMQ leaves them behind)

    def bind(self, name: str) -> list[str]:
        """Bind both sockets: where the peer sends (our receiving socket), where it receives
        (ports of ``tcp://127.0.0.1:0`` resolved)."""
        if self._transport == "tcp":
            wanted = ["tcp://127.0.0.1:0", "tcp://127.0.0.1:0"]
        else:
            base = f"ipc://{tempfile.gettempdir()}/actorserve-{os.getpid()}-{name}"
            wanted = [f"{base}-up.sock", f"{base}-down.sock"]
        endpoints = [_bind(self._rx, wanted[0]), _bind(self._tx, wanted[1])]
        self._files = [e.removeprefix("ipc://") for e in endpoints if e.startswith("ipc://")]
        return endpoints

    def connect(self, endpoints: list[str]) -> None:
        """Connect to a bound peer: we send where it receives and receive where it sends."""
        peer_rx, peer_tx = endpoints
        self._rx.connect(peer_tx)
        self._tx.connect(peer_rx)

    def send(self, kind: int, corr: int = 0, body: bytes = b"") -> None:
        # EAGAIN: the parent's sending socket is bound, and the child's connection may not be
        # attached yet; the backlog is retried on a timer.
        if not self._usable():
            return
        data = message(kind, corr, body)
        try:
            if self._backlog or not self._try_send(data):
                self._backlog.append(data)
                if len(self._backlog) == 1:
                    self._retry()
        except LinkBroken as exc:
            self._fail(exc)

    def _try_send(self, data: bytes | bytearray | memoryview) -> bool:
        try:
            _send(self._tx, data, _NOBLOCK, len(data) < _COPY_BELOW)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            raise LinkBroken(f"send failed: {exc}") from exc
        return True

    def _write_backlog(self) -> bool:
        backlog = self._backlog
        while backlog and self._try_send(backlog[0]):
            backlog.popleft()
        return not backlog

    def _read(self) -> None:
        rx = self._rx
        handle = self._on_message
        while True:
            try:
                data = _recv(rx, _NOBLOCK)
            except zmq.Again:
                return  # it processed the socket's commands: the FD will signal what comes
            handle(*parse(data))
            if self.closed or not _get(rx, _EVENTS) & _POLLIN:
                return

    def _close(self, linger: float) -> None:
        self._rx.close(linger=0)
        self._tx.close(linger=int(linger * 1000))
        for path in self._files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _bind(sock: zmq.Socket[bytes], endpoint: str) -> str:
    if endpoint.endswith(":0"):
        host = endpoint.rsplit(":", 1)[0]
        return f"{host}:{sock.bind_to_random_port(host)}"
    sock.bind(endpoint)
    return endpoint
