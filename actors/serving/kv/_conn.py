"""Decode's connection to one prefill bootstrap endpoint, and the rooms pending on it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import msgspec

from actors.lowlevel import AsyncSocket
from actors.serving.kv._channel import Channel
from actors.serving.kv._pool import PageAllocation
from protocols.errors import KVTransferError, RequestError, error_from_wire
from protocols.kv import (
    BootstrapMessage,
    CancelRoom,
    Hello,
    Ping,
    Pong,
    Reject,
    RoomClosed,
    RoomFailed,
    TransferNotification,
    UnknownPeer,
    Welcome,
    Writing,
    decode_message,
    encode_message,
)

__all__ = ["PendingRoom", "PrefillConnection"]

_HELLO_MIN_INTERVAL = 0.05  # several triggers (Pong, UnknownPeer) may ask for one re-Hello


@dataclass(eq=False, slots=True)
class PendingRoom:
    """A room decode asked for and is waiting on."""

    room: int
    pages: PageAllocation
    done: anyio.Event
    conn: PrefillConnection | None = None
    incarnation: int | None = None  # of the prefill agent the request went to
    sent: bool = False
    writing: bool = False  # prefill announced the WRITE
    terminal: bool = False  # nothing more will be written into the pages
    notif: TransferNotification | None = None
    error: RequestError | None = None

    def finish(
        self, *, notif: TransferNotification | None = None, error: RequestError | None = None
    ) -> None:
        if self.terminal:
            return
        self.terminal = True
        self.notif = notif
        self.error = error
        if self.writing and self.conn is not None:
            self.conn.writing -= 1
            self.writing = False
        self.done.set()


def _migratable(code: str, message: str) -> RequestError:
    err = error_from_wire(code, message)
    if isinstance(err, KVTransferError):
        return err
    # Whatever prefill reports, to decode it is a failed hand-off: let the request migrate.
    return KVTransferError(f"{code}: {message}" if message else code)


class PrefillConnection:
    """One DEALER to a prefill worker's bootstrap ROUTER, with its reader task (:meth:`run`)."""

    def __init__(
        self,
        endpoint: str,
        sock: AsyncSocket,
        hello: Hello,
        poke: Callable[[], None],
        changed: Callable[[], None],
    ) -> None:
        self.endpoint = endpoint
        self.chan = Channel(sock, self._on_frames)
        self._hello = hello
        self._poke = poke
        self._on_change = changed  # the service's "rooms or quarantine changed"
        self.rooms: dict[int, PendingRoom] = {}
        self.quarantine: dict[int, PageAllocation] = {}
        self.welcome: Welcome | None = None
        self.rejected: str | None = None
        self.last_seen = time.monotonic()
        self.hello_sent_at = 0.0
        self.restarts_seen = 0
        self.writing = 0
        self._seq = 0
        self._known_incarnation: int | None = None
        self._changed = anyio.Event()
        self._reader: anyio.CancelScope | None = None

    @property
    def ready(self) -> bool:
        return self.welcome is not None

    @property
    def settled(self) -> bool:
        """Welcomed and not rejected since: :meth:`wait_ready` would return at once."""
        return self.welcome is not None and self.rejected is None

    @property
    def idle(self) -> bool:
        """No room waits on this connection and no page of ours is quarantined on it."""
        return not self.rooms and not self.quarantine

    @property
    def incarnation(self) -> int | None:
        return self.welcome.incarnation if self.welcome is not None else None

    @property
    def agent_name(self) -> str | None:
        return self.welcome.agent_name if self.welcome is not None else None

    async def wait_ready(self, timeout: float) -> None:
        """Wait for ``Welcome``; :class:`KVTransferError` if rejected or silent."""
        # No timer when it is settled already: every receive asks (a drain's burst of them).
        if self.welcome is None and self.rejected is None:
            with anyio.move_on_after(timeout):
                while self.welcome is None and self.rejected is None:
                    await self._changed.wait()
        if self.rejected is not None:
            raise KVTransferError(f"prefill at {self.endpoint} rejected us: {self.rejected}")
        if self.welcome is None:
            raise KVTransferError(f"prefill at {self.endpoint} did not answer in {timeout:.3g} s")

    # -- sending ----------------------------------------------------------------------------

    def send(self, msg: BootstrapMessage) -> None:
        self.chan.send([encode_message(msg)])

    def say_hello(self) -> None:
        now = time.monotonic()
        if now - self.hello_sent_at >= _HELLO_MIN_INTERVAL:
            self.hello_sent_at = now
            self.send(self._hello)

    def ping(self) -> None:
        self._seq += 1
        self.send(Ping(seq=self._seq))

    def cancel(self, room: int) -> None:
        self.send(CancelRoom(room=room))

    # -- state --------------------------------------------------------------------------------

    def lost(self, error: RequestError, *, release: bool = True) -> None:
        """The prefill incarnation we knew is gone: fail its rooms, free quarantined pages."""
        self.welcome = None
        for pending in list(self.rooms.values()):
            pending.finish(error=error)
        if release:
            for alloc in self.quarantine.values():
                alloc.free()
            self.quarantine.clear()
        self._notify()
        self._on_change()

    def release_quarantined(self, room: int) -> bool:
        alloc = self.quarantine.pop(room, None)
        if alloc is None:
            return False
        alloc.free()
        self._on_change()
        return True

    def close(self) -> None:
        # The reader stops first: woken by its socket's closing, it would read a closed socket
        # (ENOTSOCK) and fail the service's task group (a forgotten silent peer, seen in tests).
        if self._reader is not None:
            self._reader.cancel()
        self.chan.close()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    # -- the reader ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Read prefill's messages until cancelled (or closed)."""
        with anyio.CancelScope() as self._reader:
            if not self.chan.closed:
                await self.chan.run()

    def _on_frames(self, frames: list[bytes]) -> None:
        try:
            msg = decode_message(frames[-1])
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        self.last_seen = time.monotonic()
        self._handle(msg)

    def _handle(self, msg: BootstrapMessage) -> None:
        if isinstance(msg, Welcome):
            if self.welcome is not None and msg.incarnation != self.welcome.incarnation:
                self.lost(KVTransferError(f"prefill at {self.endpoint} restarted"))
            if self._known_incarnation not in (None, msg.incarnation):
                self.restarts_seen += 1
            self._known_incarnation = msg.incarnation
            self.welcome = msg
            self.rejected = None
            self._notify()
        elif isinstance(msg, Reject):
            self.rejected = msg.reason
            self._notify()
        elif isinstance(msg, Pong):
            if self.welcome is not None and msg.incarnation != self.welcome.incarnation:
                self.lost(KVTransferError(f"prefill at {self.endpoint} restarted"))
            if self.welcome is None:
                self.say_hello()
        elif isinstance(msg, UnknownPeer):
            if self.welcome is not None:
                self.lost(KVTransferError(f"prefill at {self.endpoint} no longer knows us"))
            self.say_hello()
        elif isinstance(msg, Writing):
            marked = False
            for room in (msg.room, *msg.more):
                pending = self.rooms.get(room)
                if pending is not None and not pending.writing and not pending.terminal:
                    pending.writing = True
                    self.writing += 1
                    marked = True
            if marked:
                self._poke()
        elif isinstance(msg, RoomClosed | RoomFailed):
            if self.release_quarantined(msg.room):
                return
            pending = self.rooms.get(msg.room)
            if pending is not None:
                if isinstance(msg, RoomFailed):
                    pending.finish(error=_migratable(msg.code, msg.message))
                else:
                    pending.finish(error=KVTransferError(f"prefill closed room {msg.room}"))
