"""The parent side of a process actor: :class:`ProcessActor`.

Its incarnation is one OS process. Callers' tells, asks and streams go straight onto the link
(the actor's ref is bound to a forwarder, not to the local mailbox). The process's death is seen
through its sentinel FD at once and fails every pending call; a silent process (SIGSTOP, a
deadlock, a dead socket) is caught by the heartbeat timeout and killed. A unix link also tells
when the child's end closes: a child that lives on without it is killed, a :class:`LinkBroken`
failure. (On trio, while no call waits, nobody reads the link: what arrived, a closed end
included, is read at the next heartbeat check.)
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import shutil
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import attrs
import msgspec

from actors._actor import Actor
from actors._backends import Reply, backend
from actors._backends._loops import Loop, default_loop
from actors._errors import ActorCrashed, ActorError, ActorNotRunning
from actors._exit import ExitReason
from actors._mailbox import ASK, STREAM, TELL, Item
from actors._ref import crash_error
from actors._stream import StreamChannel
from actors.process import _frames as f
from actors.process._child import ChildOptions
from actors.process._link import LinkBroken, Transport, new_link
from actors.process._spawn import exit_code, preload, start_process
from actors.telemetry import log_settings
from protocols import codec

__all__ = ["ProcessActor", "ProcessDied", "ProcessOptions"]

_ids = itertools.count(1)
_LAST_FRAMES_S = 0.02
_START_ERROR_S = 0.25
# How long a closed link waits for the process's exit before the process counts as alive without
# it (a SIGKILL closes the child's socket a moment before its pidfd fires).
_LINK_GRACE_S = 0.25


@attrs.frozen
class ProcessOptions:
    """How a process actor runs and how it is watched and stopped."""

    # "unix": a Unix-domain stream socket (the fastest); "ipc"/"tcp": ZMQ (tcp://127.0.0.1).
    transport: Transport = "unix"
    # The child's event loop; "uvloop": asyncio on uvloop's loop (the uvloop extra), which halves
    # what the child spends on a round trip.
    backend: Loop = "asyncio"
    start_timeout: float = 60.0
    heartbeat_interval: float = 0.2
    heartbeat_timeout: float = 3.0  # no frame for this long: the child is hung, kill it
    stop_timeout: float = 5.0  # graceful stop request, then SIGTERM
    term_timeout: float = 2.0  # SIGTERM, then SIGKILL


class ProcessDied(ActorError):
    """The actor's OS process ended without the actor exiting cleanly."""

    def __init__(self, name: str, exitcode: int | None, cause: str | None = None) -> None:
        if exitcode is None:
            how = "exited"
        elif exitcode < 0:
            how = f"signal {-exitcode}"
        else:
            how = f"exit code {exitcode}"
        detail = f" ({cause})" if cause else ""
        super().__init__(f"process of {name!r} died: {how}{detail}")
        self.exitcode = exitcode
        self.cause = cause


class _Forwarder:
    """The inbox callers' messages go to: messages on the link, replies matched by id."""

    capacity = 1 << 62

    def __init__(self, owner: ProcessActor) -> None:
        self._owner = owner
        self.put_count = 0

    def __len__(self) -> int:
        return len(self._owner.asks) + len(self._owner.streams)

    def try_put(self, item: Item) -> bool:
        """Send ``item`` (unbounded, capacity 2**62: a send never waits for room)."""
        kind, message, extra = item
        owner = self._owner
        wire = owner.wire
        if wire.closed or wire.broken or owner.exited:
            raise ActorNotRunning(owner.ref.name)
        body = codec.encode(message)
        self.put_count += 1
        if kind == ASK:
            corr = next(_ids)
            owner.asks[corr] = extra
            if owner.reply_reader is not None:
                extra.reader = owner.reply_reader  # the asker may read its reply itself (trio)
            wire.send(f.ASK, corr, body)
        elif kind == TELL:
            wire.send(f.TELL, 0, body)
        elif kind == STREAM:
            corr = next(_ids)
            channel: StreamChannel = extra
            owner.streams[corr] = channel
            channel.hooks = _Credit(owner, corr, channel.capacity)
            wire.send(f.STREAM, corr, f.count(channel.capacity) + body)
            wire.resume_reading()  # its items come unasked
        return True

    def put_nowait(self, item: Item) -> None:
        self.try_put(item)

    put_system = put_nowait

    def abandon(self, reply: Any) -> None:
        """The caller gave up: abort the remote handler."""
        owner = self._owner
        for corr, pending in owner.asks.items():
            if pending is reply:
                del owner.asks[corr]
                owner.send_quietly(f.CANCEL, corr)
                return

    async def put(self, item: Item) -> bool:
        self.put_nowait(item)
        return True


class _Credit:
    """Returns credit to the producing child as the consumer takes items (half a window at a
    time, so the producer never waits on a full round trip while the consumer has work)."""

    __slots__ = ("_corr", "_owner", "_taken", "_window")

    def __init__(self, owner: ProcessActor, corr: int, window: int) -> None:
        self._owner = owner
        self._corr = corr
        self._window = max(1, window // 2)
        self._taken = 0

    def consumed(self) -> None:
        self._taken += 1
        if self._taken >= self._window and self._corr in self._owner.streams:
            # Credit is best effort: if the process is gone, the stream fails on its own.
            self._owner.send_quietly(f.CREDIT, self._corr, f.count(self._taken))
            self._taken = 0

    def cancelled(self) -> None:
        owner = self._owner
        if owner.streams.pop(self._corr, None) is not None:
            owner.send_quietly(f.CANCEL, self._corr)


class ProcessActor(Actor):
    """An actor running in its own OS process, built there by ``factory(*args)``.

    ``factory`` is an import path (``"package.module:Class"``); ``args`` must be encodable by
    :mod:`protocols.codec`. Its ref is used exactly like a local actor's.
    """

    def __init__(
        self, factory: str, *args: Any, options: ProcessOptions | None = None, name: str = ""
    ) -> None:
        self.factory = factory
        self.args = args
        self.options = options or ProcessOptions()
        self.process_name = name or factory.rpartition(":")[2]
        self.asks: dict[int, Reply] = {}
        self.streams: dict[int, StreamChannel] = {}
        self._pid: int | None = None
        self._pidfd: int | None = None
        self._tmpdir: str | None = None
        self._exitcode: int | None = None
        self._forwarder = _Forwarder(self)
        self._last_seen = time.monotonic()
        self._kill_cause: str | None = None
        self._remote_exit: ExitReason | None = None
        self._stopping = False
        self._exited = anyio.Event()
        self.exited = False  # _exited.is_set(), read on every call
        self._ready: Reply | None = None
        self.wire = new_link(self.options.transport, self._on_message)
        # Only replies are awaited while no stream runs and the start is over: the link's task
        # may then leave reading to askers (trio; see Link.read_for).
        self.wire.idle = self._idle
        self.reply_reader: Callable[[Any], Awaitable[Any] | None] | None = None

    def inbox_override(self) -> _Forwarder:
        return self._forwarder

    @property
    def pid(self) -> int | None:
        """The OS process id of the current incarnation."""
        return self._pid

    # -- lifecycle -------------------------------------------------------------------------

    async def started(self) -> None:
        try:
            await self._start()
        except BaseException:
            if self._alive():
                self._signal(signal.SIGKILL)
            self._shutdown(ActorCrashed(self.ref.name, ExitReason.killed("start failed")))
            self._remove_tmpdir()
            raise

    async def _start(self) -> None:
        opts = self.options
        if opts.backend == "uvloop":
            if default_loop() != "uvloop":
                raise ValueError("ProcessOptions(backend='uvloop') needs uvloop installed")
            preload(["uvloop"])
        endpoints = self.wire.bind(f"{next(_ids)}")
        # The child's temporary files (its sockets among them) go to a directory of its own,
        # removed once it is gone: a SIGKILLed child cannot clean up after itself.
        self._tmpdir = tempfile.mkdtemp(prefix="actorserve-")
        options = msgspec.msgpack.encode(
            ChildOptions(
                self.process_name,
                opts.backend,
                opts.heartbeat_interval,
                os.getpid(),
                self._tmpdir,
                log_settings(),
            )
        )
        loop = backend()
        self._ready = loop.reply()
        if loop.name == "trio":
            self.reply_reader = self.wire.read_for
        self.start_soon(self._serve_link, name=f"{self.process_name} link")
        self._pid = await anyio.to_thread.run_sync(
            start_process,
            endpoints,
            self.factory,
            codec.encode(list(self.args)),
            options,
            self._tmpdir,
        )
        # A pidfd becomes readable the instant the process exits, whoever its parent is.
        self._pidfd = os.pidfd_open(self._pid)
        self.start_soon(self._watch_process, name=f"{self.process_name} sentinel")
        await self._ready.wait(opts.start_timeout)
        self._last_seen = time.monotonic()
        self.start_soon(self._watch_heartbeat, name=f"{self.process_name} heartbeat")

    async def stopping(self, reason: ExitReason) -> None:
        self._stopping = True
        self._runtime.dying = True  # the child refuses new calls from now on: not running
        if self._alive():
            self.send_quietly(f.STOP, 0, msgspec.msgpack.encode((reason.kind, reason.detail or "")))
            for sig, budget in (
                (None, self.options.stop_timeout),
                (signal.SIGTERM, self.options.term_timeout),
            ):
                if sig is not None and self._alive():
                    self._signal(sig)
                with anyio.move_on_after(budget):
                    while self._alive():
                        await self._wait_exit()
        self._shutdown(crash_error(self.ref.name, reason))

    async def _wait_exit(self) -> None:
        if self._exited.is_set() or self._pidfd is None:
            await anyio.sleep(0.005)  # the sentinel watcher is gone (crash path): poll briefly
        else:
            # Bounded: the sentinel watcher that sets the event may already be cancelled (the
            # child's abnormal EXIT frame crashed us first), so the caller's loop re-checks.
            with anyio.move_on_after(0.05):
                await self._exited.wait()

    # -- watching ------------------------------------------------------------------------------

    async def _watch_process(self) -> None:
        assert self._pidfd is not None and self._pid is not None
        try:
            await anyio.wait_readable(self._pidfd)
            self._exited.set()
            self.exited = True
            self._runtime.dying = True
            self.wire.drain()  # frames it sent before exiting (START_FAILED, EXIT) come first
            if self._stopping:
                return
            if self._remote_exit is None:
                # Fail every pending call now (a SIGKILL sends no EXIT), then give a last frame
                # still in flight through ZMQ's I/O thread (EXIT, or START_FAILED while starting)
                # a moment to tell a clean stop or the start error.
                cause = self._kill_cause
                died = ProcessDied(self.ref.name, None, cause)
                self._fail_calls(ActorCrashed(self.ref.name, ExitReason.from_error(died)))
                starting = not self._ready_done()
                # A start error is worth a longer wait: nothing is on a latency path then. A
                # closed unix link has delivered everything already.
                with anyio.move_on_after(_START_ERROR_S if starting else _LAST_FRAMES_S):
                    while (
                        self._remote_exit is None
                        and not self.wire.peer_closed
                        and not (starting and self._ready_done())
                    ):
                        await anyio.sleep(0.001)
                        self.wire.drain()
            remote = self._remote_exit
            if remote is not None and not remote.is_abnormal:
                self._shutdown(crash_error(self.ref.name, remote))
                self.stop(remote)
                return
            cause = self._kill_cause or (str(remote) if remote is not None else None)
            self._shutdown(
                ActorCrashed(
                    self.ref.name, ExitReason.from_error(ProcessDied(self.ref.name, None, cause))
                )
            )
            self._exitcode = await anyio.to_thread.run_sync(exit_code, self._pid)
            error = ProcessDied(self.ref.name, self._exitcode, cause)
            if self._ready is not None and not self._ready.done:
                self._ready.fail(error)  # started() raises it: a start failure, not a crash
                return
            raise error
        finally:
            if self._alive():
                self._signal(signal.SIGKILL)
            self._shutdown(ActorCrashed(self.ref.name, ExitReason.killed()))
            self._remove_tmpdir()

    def _remove_tmpdir(self) -> None:
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    async def _serve_link(self) -> None:
        try:
            await self.wire.run()
        except LinkBroken as exc:
            if self._stopping or self._remote_exit is not None:
                return  # it was asked to go, or said goodbye: its end closes as it exits
            # Most likely the process is exiting, and its sentinel tells how; one that lives on
            # without its link is of no use.
            with anyio.move_on_after(_LINK_GRACE_S):
                await self._exited.wait()
            if self._exited.is_set():
                return
            self._fail_calls(ActorCrashed(self.ref.name, ExitReason.from_error(exc)))
            self._signal(signal.SIGKILL)
            raise

    async def _watch_heartbeat(self) -> None:
        opts = self.options
        while True:
            wait = opts.heartbeat_interval
            if not self.wire.may_stand_by:
                # Nothing to drain: check once the timeout could have run out, not at every
                # interval (a serving root's checks were a fifth of its wake-ups while idle).
                wait = max(wait, self._last_seen + opts.heartbeat_timeout - time.monotonic())
            await anyio.sleep(wait)
            self.wire.drain_unread()  # heartbeats nobody read (no call waited)
            if time.monotonic() - self._last_seen > opts.heartbeat_timeout and self._alive():
                self._kill_cause = f"no heartbeat for {opts.heartbeat_timeout} s"
                self._signal(signal.SIGKILL)
                return

    def _on_message(self, kind: int, corr: int, body: f.Body) -> None:
        self._last_seen = time.monotonic()
        # A stream's items first: the most frequent message (one per engine step and stream).
        if kind == f.ITEMS or kind == f.END:
            channel = self.streams.get(corr) if kind == f.ITEMS else self.streams.pop(corr, None)
            if channel is None:
                return
            if body:
                try:
                    channel.push_many(codec.decode_many(body))
                except codec.CodecError as exc:
                    if self.streams.pop(corr, None) is not None:
                        self.send_quietly(f.CANCEL, corr)
                    channel.fail(exc)
                    return
            if kind == f.END:
                channel.finish()
        elif kind == f.REPLY:
            reply = self.asks.pop(corr, None)
            if reply is not None:
                try:
                    reply.set(codec.decode(body))
                except codec.CodecError as exc:
                    reply.fail(exc)
        elif kind == f.ERROR:
            error = codec.decode_error(body)
            if isinstance(error, codec.RemoteError) and error.type_name.endswith(
                "._errors.ActorNotRunning"
            ):
                # The actor in the child is stopping (a SIGTERM): to callers it is not running,
                # a typed actor error (a request stream migrates it), not an opaque remote one.
                error = ActorNotRunning(self.ref.name)
            pending = self.asks.pop(corr, None) or self.streams.pop(corr, None)
            if pending is not None:
                pending.fail(error)
        elif kind == f.READY:
            if self._ready is not None:
                self._ready.set(None)
        elif kind == f.START_FAILED:
            if self._ready is not None:
                self._ready.fail(codec.decode_error(body))
        elif kind == f.EXIT:
            kind_name, detail = msgspec.msgpack.decode(body)
            remote = self._remote_exit = ExitReason(kind_name, detail or None)
            if remote.is_abnormal:
                # The process is about to exit: crash now, callers need not wait for that.
                error = ProcessDied(self.ref.name, None, str(remote))
                self._fail_calls(ActorCrashed(self.ref.name, ExitReason.from_error(error)))
                raise error

    # -- helpers --------------------------------------------------------------------------------

    def send_quietly(self, kind: int, corr: int, body: bytes = b"") -> None:
        """Send if the link is up: for best-effort messages (credit, cancel, stop) that lose
        their point once the process is gone."""
        if not self.wire.closed:
            with contextlib.suppress(LinkBroken):
                self.wire.send(kind, corr, body)

    def _idle(self) -> bool:
        return not self.asks and not self.streams and self._ready_done()

    def _ready_done(self) -> bool:
        return self._ready is None or self._ready.done

    def _alive(self) -> bool:
        if self._pidfd is None or self._exited.is_set():
            return False
        # Readable pidfd: the process has exited (poll without blocking).
        readable, _, _ = select.select([self._pidfd], [], [], 0)
        return not readable

    def _signal(self, sig: int) -> None:
        if self._pidfd is not None and self._alive():
            signal.pidfd_send_signal(self._pidfd, sig)

    def _fail_calls(self, error: BaseException) -> None:
        asks, self.asks = self.asks, {}
        streams, self.streams = self.streams, {}
        for reply in asks.values():
            reply.fail(error)
        for channel in streams.values():
            channel.fail(error)

    def _shutdown(self, error: BaseException) -> None:
        """Fail every pending call and close the socket (idempotent)."""
        # A call made before the incarnation is unbound would fail at once (the socket is
        # closed): ``ActorRef.is_running`` must say so meanwhile, or a router picks it.
        self._runtime.dying = True
        self._fail_calls(error)
        self.wire.close()
        if self._pidfd is not None and not self._alive():
            os.close(self._pidfd)
            self._pidfd = None
