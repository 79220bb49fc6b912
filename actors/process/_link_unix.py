"""A :class:`~actors.process._link.Link` over one Unix-domain stream socket (no ZMQ).

The parent listens on a socket file in a private directory (``tempfile.mkdtemp``: mode 0700, the
file 0600, so only its owner can connect) and accepts the child's connection once :meth:`run`
starts; the file and its directory go as soon as the child is connected, or when the link closes.
A child that never connects never sends READY: the parent's start-up timeout covers it.

Each message travels as a frame: a 4-byte big-endian length, then the message (the ``_frames``
header and body; that header has no length, the stream needs one).

Reading: one ``recv_into`` fills a 256 KiB buffer and every complete frame in it is handled in
that wake-up, its body handed over as a copy (a view of the buffer, reused by the next read,
could outlive the handler: a decoded ``msgspec.Raw`` field points into what it was decoded
from). A frame cut by the end of a read waits for the next one (moved to the front of the buffer
if it would not fit where it is); a frame larger than the buffer gets a buffer of its own,
received into directly and handed over without a copy. A read that leaves room in the buffer
means the socket is empty, so no second ``recv`` pays for meeting EAGAIN.

Writing: length and header are packed in one go; a small message's body is copied behind them and
sent with one syscall, a large one goes out with them in one ``sendmsg``, without a copy. What the
socket does not take waits in the backlog, sent as the socket becomes writable (``sendmsg`` of many
pieces at once).

A peer that closes its end (EOF, ECONNRESET, EPIPE on a send) breaks the link: :meth:`run` raises
:class:`LinkBroken` at once.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import tempfile
import time
from itertools import islice

import anyio

from actors.process._frames import HEADER_SIZE as _HEADER_SIZE
from actors.process._frames import parse
from actors.process._link import Link, LinkBroken, MessageHandler

__all__ = ["UnixLink"]

_LENGTH = struct.Struct(">I")
_unpack_from = _LENGTH.unpack_from
_PREFIX = _LENGTH.size
# The length and the message's header (see _frames) in one: one pack per send.
_HEAD = struct.Struct(">IBQ")
_pack_head = _HEAD.pack
_unpack_head = _HEAD.unpack_from
_HEAD_SIZE = _HEAD.size
_MAX_MESSAGE = 2**32 - 1
_BUFFER = 256 * 1024
_SMALL = 16 * 1024  # below: copied behind its length (one buffer); above: sent without a copy
# The kernel charges a unix stream's queued bytes to the sender's buffer (capped by
# net.core.wmem_max): room for a burst of stream items or a large message without a backlog.
_SNDBUF = 4 * 1024 * 1024
_IOV_MAX = 512
_NOSIGNAL = socket.MSG_NOSIGNAL
_SCHEME = "unix://"


class UnixLink(Link):
    """One stream socket, connected to the peer's."""

    _flush_on_writable = True
    _asker_reads = True

    def __init__(self, on_message: MessageHandler) -> None:
        super().__init__(on_message)
        self._sock: socket.socket | None = None
        self._listener: socket.socket | None = None
        self._path = ""
        self._accepting = False
        self._buf = bytearray(_BUFFER)
        self._view = memoryview(self._buf)
        self._start = 0  # the first byte in _buf not handled yet
        self._end = 0  # the end of what was received into _buf
        self._big: bytearray | None = None  # a frame larger than _buf, being received
        self._big_filled = 0

    # -- connecting ------------------------------------------------------------------------

    def bind(self, name: str) -> list[str]:
        """Listen on a fresh socket file only this user can reach; its ``unix://`` endpoint."""
        path = os.path.join(tempfile.mkdtemp(prefix=f"actorserve-{name}-"), "link.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener, self._path = listener, path
        try:
            listener.bind(path)
            os.chmod(path, 0o600)
            listener.listen(1)
            listener.setblocking(False)
        except OSError:
            self._stop_listening()
            raise
        return [_SCHEME + path]

    def connect(self, endpoints: list[str]) -> None:
        """Connect to the parent's socket (``LinkBroken`` if it is gone)."""
        path = endpoints[0].removeprefix(_SCHEME)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            raise LinkBroken(f"cannot connect to {path}: {exc}") from exc
        self._adopt(sock)

    async def _wait_peer(self) -> None:
        listener = self._listener
        if listener is None:
            return
        self._accepting = True
        try:
            while True:
                try:
                    sock, _ = listener.accept()
                    break
                except BlockingIOError:
                    await anyio.wait_readable(listener)
        except anyio.ClosedResourceError:
            return  # closed while waiting
        except OSError as exc:
            raise LinkBroken(f"accepting the peer failed: {exc}") from exc
        finally:
            self._accepting = False
        self._adopt(sock)
        self._stop_listening()

    def _adopt(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SNDBUF)
        self._sock = sock
        self._fd = sock.fileno()

    def _stop_listening(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(os.path.dirname(self._path))

    # -- sending ---------------------------------------------------------------------------

    def send(self, kind: int, corr: int = 0, body: bytes = b"") -> None:
        if self.closed or self.broken:
            self._usable()  # raises once closed; on a broken link the message is dropped
            return
        size = _HEADER_SIZE + len(body)
        pieces: tuple[bytes, ...]
        if size < _SMALL:
            data = _pack_head(size, kind, corr) + body
            sock = self._sock
            if sock is not None and not self._backlog:  # the usual case: one send
                try:
                    sent = sock.send(data, _NOSIGNAL)
                except BlockingIOError:
                    sent = 0
                except OSError as exc:
                    self._fail(_broken("send", exc))
                    return
                if sent < len(data):
                    self._backlog.append(data)
                    self._consume(sent)
                    self._retry()
                return
            pieces = (data,)
        elif size <= _MAX_MESSAGE:
            pieces = (_pack_head(size, kind, corr), body)
        else:
            raise ValueError(f"a message of {size} bytes is over the unix link's 4 GiB limit")
        self._send_pieces(pieces)

    def _send_pieces(self, pieces: tuple[bytes, ...]) -> None:
        sock = self._sock
        if self._backlog or sock is None:
            self._backlog.extend(pieces)  # after what waits, or until the peer connects
            return
        try:
            sent = sock.sendmsg(pieces, (), _NOSIGNAL)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self._fail(_broken("send", exc))
            return
        if sent < sum(map(len, pieces)):
            self._backlog.extend(pieces)
            self._consume(sent)
            self._retry()

    def _write_backlog(self) -> bool:
        sock = self._sock
        assert sock is not None
        backlog = self._backlog
        while backlog:
            pieces = list(islice(backlog, _IOV_MAX))
            try:
                sent = sock.sendmsg(pieces, (), _NOSIGNAL)
            except BlockingIOError:
                return False
            except OSError as exc:
                raise _broken("send", exc) from exc
            self._consume(sent)
            if sent < sum(len(piece) for piece in pieces):
                return False
        return True

    def _consume(self, sent: int) -> None:
        """Drop ``sent`` bytes off the front of the backlog."""
        backlog = self._backlog
        while sent:
            head = backlog[0]
            if sent < len(head):
                backlog[0] = memoryview(head)[sent:]
                return
            sent -= len(head)
            backlog.popleft()

    # -- receiving -------------------------------------------------------------------------

    def _read(self) -> None:
        sock = self._sock
        if sock is None:
            return  # not accepted yet: what the peer sent waits in its connection
        buf, view, handle = self._buf, self._view, self._on_message
        if self._end and self._end - self._start >= _PREFIX:
            self._handle_frames()  # left by a handler that raised
        while not self.closed:
            big, end = self._big, self._end
            if big is not None:
                target = memoryview(big)[self._big_filled :]
            elif end:
                target = view[end:]
            else:
                target = view
            try:
                n = sock.recv_into(target)
            except BlockingIOError:
                return
            except OSError as exc:
                self.peer_closed = True
                raise _broken("receive", exc) from exc
            if not n:
                self.peer_closed = True
                raise LinkBroken("the peer closed the link")
            if target is view and n >= _HEAD_SIZE and n == _PREFIX + (head := _unpack_head(buf))[0]:
                handle(head[1], head[2], buf[_HEAD_SIZE:n])  # one whole frame: the usual case
            elif big is not None:
                self._big_filled += n
                if self._big_filled == len(big):
                    self._big = None
                    handle(*parse(big))
            else:
                self._end = end + n
                self._handle_frames()
            if n < len(target):
                return  # a short read: the socket is empty now

    def _handle_frames(self) -> None:
        buf, end, handle = self._buf, self._end, self._on_message
        pos = self._start
        try:
            while end - pos >= _PREFIX:
                size = _unpack_from(buf, pos)[0]
                if size < _HEADER_SIZE:
                    raise LinkBroken(f"a malformed frame: {size} bytes, no room for a header")
                stop = pos + _PREFIX + size
                if stop > end:
                    break
                _, kind, corr = _unpack_head(buf, pos)
                body = buf[pos + _HEAD_SIZE : stop]
                pos = stop
                handle(kind, corr, body)
                if self.closed:
                    return
        finally:
            self._settle(pos)

    def _settle(self, pos: int) -> None:
        """Keep the unhandled rest from ``pos``, with room after it for the next read."""
        buf, end = self._buf, self._end
        rest = end - pos
        if not rest:
            self._start = self._end = 0
            return
        need = _PREFIX + _unpack_from(buf, pos)[0] if rest >= _PREFIX else _PREFIX
        if need > len(buf):
            big = bytearray(need - _PREFIX)
            big[: rest - _PREFIX] = buf[pos + _PREFIX : end]
            self._big, self._big_filled = big, rest - _PREFIX
            self._start = self._end = 0
        elif pos + need > len(buf):
            buf[:rest] = buf[pos:end]
            self._start, self._end = 0, rest
        else:
            self._start = pos

    # -- closing ---------------------------------------------------------------------------

    def _close(self, linger: float) -> None:
        if self._listener is not None:
            if self._accepting:
                anyio.notify_closing(self._listener)  # the accepting task gets ClosedResourceError
            self._stop_listening()
        sock = self._sock
        if sock is not None:
            if linger > 0 and self._backlog and not self.broken:
                self._flush_blocking(sock, linger)
            sock.close()

    def _flush_blocking(self, sock: socket.socket, linger: float) -> None:
        deadline = time.monotonic() + linger
        poller = select.poll()
        poller.register(sock, select.POLLOUT)
        try:
            while not self._write_backlog():
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                poller.poll(left * 1000)
        except LinkBroken:
            return


def _broken(operation: str, exc: OSError) -> LinkBroken:
    return LinkBroken(f"{operation} failed: {exc}")
