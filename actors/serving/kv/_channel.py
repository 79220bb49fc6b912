"""A ZMQ socket whose incoming messages go to a synchronous handler, with no lost wake-up.

A ZMQ socket's ``FD`` is edge-triggered, and *any* operation on the socket (a send, reading
``EVENTS``) may consume the edge that announced incoming messages. A task parked in
``wait_readable`` while another task sends can then sleep on with messages queued (seen here under
trio: heartbeats stalled past the peer timeout). So every send is followed by a drain of what is
readable, and the reader task drains after every wake-up; the handler runs in whichever task
drains, never re-entered.

A drain reads ``EVENTS`` before each receive: a receive that finds nothing raises ``zmq.Again``,
which costs twice the check, and the check that ends a drain re-arms the edge, so a parked reader
is woken by the next message. (Hence a send skips the socket's own wake-up check: the drain right
after it, or the one further up the stack, reads ``EVENTS`` anyway.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from actors.lowlevel import AsyncSocket, has_input

__all__ = ["Channel"]


class Channel:
    """Wraps an :class:`AsyncSocket` (and owns it); ``handler`` gets each message's frames."""

    def __init__(self, sock: AsyncSocket, handler: Callable[[list[bytes]], None]) -> None:
        self.sock = sock
        self._handler = handler
        self._draining = False

    def send(self, frames: Sequence[bytes]) -> bool:
        """Send without blocking (``False`` if it could not be queued), then drain."""
        if self.sock.closed:
            return False
        sent = self.sock.send_multipart_nowait(frames, wake=False)
        self.drain()
        return sent

    def drain(self) -> None:
        """Hand every message already received to the handler."""
        sock = self.sock
        if self._draining or sock.closed:
            return  # the drain further up the stack picks up what arrives meanwhile
        self._draining = True
        try:
            while not sock.closed and has_input(sock.socket):
                frames = sock.recv_multipart_nowait()
                if frames is None:
                    break
                self._handler(frames)
        finally:
            self._draining = False

    async def run(self) -> None:
        """The reader task: wait for the socket and drain, until cancelled."""
        while True:
            await self.sock.wait_readable()
            self.drain()

    def close(self) -> None:
        self.sock.close()

    @property
    def closed(self) -> bool:
        return self.sock.closed
