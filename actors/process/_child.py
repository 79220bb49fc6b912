"""The child side of a process actor: runs one actor and serves its parent over a Link.

Entered in a process forked by the forkserver. Asks and streams go straight into the actor's
mailbox with reply objects that answer over the link, so the child adds no hop of its own. When
the parent closes its end of a (unix) link, the child abandons what runs and stops: nobody is left
to serve.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import os
import signal
import tempfile
from typing import Any

import anyio
import msgspec

from actors._backends import Backend, backend
from actors._backends._loops import run_on
from actors._errors import ActorCrashed, StreamCancelled
from actors._exit import ExitReason
from actors._mailbox import ASK_ABORTABLE, STREAM, TELL
from actors._ref import ActorRef, Cell, CellState
from actors._runtime import Incarnation
from actors._stream import StreamChannel
from actors._zmq import context
from actors.process import _frames as f
from actors.process._link import Link, LinkBroken, connect_link
from actors.telemetry import configure_logging
from protocols import codec

__all__ = ["main", "resolve"]

_PR_SET_PDEATHSIG = 1
_LAST_WORDS_S = 2.0  # how long a dying child may take to deliver START_FAILED / EXIT


class ChildOptions(msgspec.Struct, frozen=True):
    name: str
    backend: str = "asyncio"
    heartbeat_interval: float = 0.2
    root_pid: int = 0
    tmpdir: str = ""  # ours alone; the parent removes it once we are gone
    # The parent's logging setup (level, format), so that a root's processes log alike; None:
    # the parent never configured logging (an embedding application's or a test's).
    log: tuple[str, str] | None = None


def resolve(path: str) -> Any:
    """``"package.module:attr"`` -> the object (only names our own code passes in)."""
    module, _, attr = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _die_with_parent() -> None:
    # The forkserver is our parent and exits when the root does; then the kernel kills us.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def main(endpoints: list[str], factory: str, args: bytes, options: bytes) -> None:
    """Process entry point (called by the forkserver with plain data only). ``endpoints``: where
    the parent receives, where it sends."""
    _die_with_parent()
    opts = msgspec.msgpack.decode(options, type=ChildOptions)
    if opts.tmpdir:
        os.environ["TMPDIR"] = tempfile.tempdir = opts.tmpdir
    if opts.root_pid and os.getppid() == 1:
        os._exit(1)
    if opts.log is not None:
        configure_logging(*opts.log)
    try:
        run_on(opts.backend, _serve, endpoints, factory, args, opts)
    except LinkBroken:
        pass  # the parent is gone (before we connected): nobody to report to
    finally:
        # Terminating the context flushes the lingering last frames (START_FAILED, EXIT).
        context().term()


class _RemoteReply:
    """Answers an ask over the socket; the parent's CANCEL aborts the running handler."""

    __slots__ = ("_corr", "_done", "_server", "aborted", "scope")

    def __init__(self, server: _Server, corr: int) -> None:
        self._server = server
        self._corr = corr
        self._done = False
        self.aborted = False
        self.scope: anyio.CancelScope | None = None

    def abort(self) -> None:
        self.aborted = self._done = True
        self._server.asks.pop(self._corr, None)
        if self.scope is not None:
            self.scope.cancel()

    @property
    def done(self) -> bool:
        return self._done

    def set(self, value: Any) -> None:
        if self._done:
            return
        self._done = True
        server, corr = self._server, self._corr
        server.asks.pop(corr, None)
        try:
            body = codec.encode(value)
        except codec.CodecError as exc:
            server.link.send(f.ERROR, corr, codec.encode_error(exc))
            return
        server.link.send(f.REPLY, corr, body)

    def fail(self, error: BaseException) -> None:
        if isinstance(error, ActorCrashed):
            return  # the actor is dying: the parent fails every pending call on its EXIT
        if not self._done:
            self._done = True
            server = self._server
            server.asks.pop(self._corr, None)
            server.link.send(f.ERROR, self._corr, codec.encode_error(error))

    async def wait(self, timeout: float | None) -> Any:  # never awaited in the child
        raise NotImplementedError


class _RemoteChannel(StreamChannel):
    """The producer end of a stream whose consumer is in the parent: at most ``credit`` items
    ahead of what the consumer has taken. Items go out in batches: those produced before the
    producer yields (to wait for credit, or for its own next item) make one message."""

    __slots__ = ("_batch", "_corr", "_credit", "_link", "_servers")

    def __init__(
        self,
        backend: Backend,
        link: Link,
        corr: int,
        credit: int,
        servers: dict[int, _RemoteChannel],
    ) -> None:
        super().__init__(backend, 1)
        self._link = link
        self._corr = corr
        self._credit = credit
        self._servers = servers
        self._batch: list[Any] = []

    async def send(self, item: Any) -> None:
        while self._credit <= 0 and not self.cancelled:
            await self._producer.park()
        if self.cancelled:
            raise StreamCancelled("the consumer closed the stream")
        self._credit -= 1
        batch = self._batch
        batch.append(item)
        if len(batch) == 1:
            self._link.call_soon(self._flush)

    def add_credit(self, n: int) -> None:
        self._credit += n
        self._producer.unpark()

    def _flush(self) -> None:
        if self._batch and not self.finished and not self._send_batch(f.ITEMS):
            self.cancel()  # an item could not be encoded: the consumer has the error

    def _send_batch(self, kind: int) -> bool:
        """Send the batch as ``kind``; an item that cannot be encoded fails the stream with a
        ``CodecError`` instead."""
        batch, self._batch = self._batch, []
        try:
            body = codec.encode_many(batch) if batch else b""
        except codec.CodecError as exc:
            self._link.send(f.ERROR, self._corr, codec.encode_error(exc))
            return False
        self._link.send(kind, self._corr, body)
        return True

    def finish(self) -> None:
        if not self.finished:
            self.finished = True
            self._servers.pop(self._corr, None)
            self._send_batch(f.END)  # the last batch rides on the end

    def fail(self, error: BaseException) -> None:
        if isinstance(error, ActorCrashed):
            return  # as for asks: the EXIT frame speaks for the crash
        if not self.finished:
            self.finished = True
            self._servers.pop(self._corr, None)
            if not self._batch or self._send_batch(f.ITEMS):
                self._link.send(f.ERROR, self._corr, codec.encode_error(error))

    def cancel(self) -> None:
        self._servers.pop(self._corr, None)
        self._batch = []
        super().cancel()


class _Server:
    def __init__(self, inc: Incarnation, endpoints: list[str]) -> None:
        self.inc = inc
        self.streams: dict[int, _RemoteChannel] = {}
        self.asks: dict[int, _RemoteReply] = {}
        self.backend = backend()  # of this event loop: looked up once, not per stream
        self.link = connect_link(endpoints, self.on_message)

    def on_message(self, kind: int, corr: int, body: f.Body) -> None:
        mailbox = self.inc.mailbox
        if kind == f.ASK:
            reply = self.asks[corr] = _RemoteReply(self, corr)
            mailbox.put_system((ASK_ABORTABLE, codec.decode(body), reply))
        elif kind == f.TELL:
            mailbox.put_system((TELL, codec.decode(body), None))
        elif kind == f.STREAM:
            channel = _RemoteChannel(
                self.backend, self.link, corr, f.parse_count(body), self.streams
            )
            self.streams[corr] = channel
            mailbox.put_system((STREAM, codec.decode(body[4:]), channel))
        elif kind == f.CREDIT:
            open_channel = self.streams.get(corr)
            if open_channel is not None:
                open_channel.add_credit(f.parse_count(body))
        elif kind == f.CANCEL:
            open_channel = self.streams.get(corr)
            if open_channel is not None:
                open_channel.cancel()
            pending = self.asks.get(corr)
            if pending is not None:
                pending.abort()
        elif kind == f.STOP:
            kind_name, detail = msgspec.msgpack.decode(body)
            self.inc.request_stop(ExitReason(kind_name, detail or None))

    async def serve(self) -> None:
        try:
            await self.link.run()
        except LinkBroken:
            # The parent closed its end (it is gone, or gave up on us): what runs is abandoned
            # as if it had cancelled it, and the actor stops.
            for channel in list(self.streams.values()):
                channel.cancel()
            for reply in list(self.asks.values()):
                reply.abort()
            self.inc.request_stop(ExitReason.shutdown("the parent closed the link"))

    async def heartbeat(self, interval: float) -> None:
        while True:
            self.link.send(f.HEARTBEAT)
            await anyio.sleep(interval)


async def _stop_on_sigterm(inc: Incarnation) -> None:
    # SIGTERM asks for a graceful stop; the parent escalates to SIGKILL if it takes too long.
    with anyio.open_signal_receiver(signal.SIGTERM) as signals:
        async for _ in signals:
            inc.request_stop(ExitReason.shutdown("SIGTERM"))


def _ignore(kind: int, corr: int, body: f.Body) -> None:
    pass


def _reason_bytes(reason: ExitReason) -> bytes:
    return msgspec.msgpack.encode((reason.kind, reason.detail or ""))


async def _serve(endpoints: list[str], factory: str, args: bytes, opts: ChildOptions) -> None:
    cell = Cell(opts.name)
    ref: ActorRef[Any] = ActorRef(cell)
    try:
        actor = resolve(factory)(*codec.decode(args))
        inc = Incarnation(actor, ref)
    except Exception as exc:
        link = connect_link(endpoints, _ignore)
        link.send(f.START_FAILED, 0, codec.encode_error(exc))
        link.close(linger=_LAST_WORDS_S)
        return
    server = _Server(inc, endpoints)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(inc.run, cell, lambda reason: CellState.DEAD)
            try:
                await inc.ready.wait(None)
            except Exception as exc:
                server.link.send(f.START_FAILED, 0, codec.encode_error(exc))
                return
            # Started: what is alive now (modules, the actor and its engine) lives as long as the
            # process, so the cyclic GC stops walking it: a full collection of an engine worker
            # is a pause for every request it serves.
            gc.freeze()
            tg.start_soon(server.serve)
            tg.start_soon(server.heartbeat, opts.heartbeat_interval)
            tg.start_soon(_stop_on_sigterm, inc)
            server.link.send(f.READY)
            await inc.finished.wait()
            assert inc.exit_reason is not None
            server.link.send(f.EXIT, 0, _reason_bytes(inc.exit_reason))
            tg.cancel_scope.cancel()
    finally:
        server.link.close(linger=_LAST_WORDS_S)
