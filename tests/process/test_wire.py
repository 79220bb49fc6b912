"""The wire of process actors: codec batches, message headers, the link (no processes)."""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from actors.process import _frames as f
from actors.process._link import Link, LinkBroken, Transport, connect_link, new_link
from protocols import codec
from protocols.control import Abort, Pause  # attrs classes
from protocols.engine import EngineOutput, PauseMode, Usage

transports = pytest.mark.parametrize("transport", ["unix", "ipc", "tcp"])


@pytest.mark.parametrize(
    "batch",
    [
        [],
        [1, "two", [3, 4], {"five": 5}, None, b"six"],
        [list(range(16))] * 100,
        [
            EngineOutput(token_ids=[1, 2]),
            EngineOutput(token_ids=[], usage=Usage(prompt_tokens=3, completion_tokens=4)),
        ],
        [PauseMode.ABORT, PauseMode.RETRACT],
        [EngineOutput(token_ids=[7]), 8, PauseMode.ABORT, "nine"],
    ],
)
def test_batch_round_trip(batch: list[Any]) -> None:
    assert codec.decode_many(codec.encode_many(batch)) == batch


def test_batch_of_attrs_messages_round_trips() -> None:
    for batch in ([Abort("r1"), Abort("r2")], [Abort("r3"), Pause(PauseMode.RETRACT), 4]):
        assert codec.decode_many(codec.encode_many(batch)) == batch


def test_single_messages_decode_from_views() -> None:
    for message in (1, "x", None, EngineOutput(token_ids=[5]), [EngineOutput(token_ids=[])]):
        data = b"pad" + codec.encode(message)
        assert codec.decode(memoryview(data)[3:]) == codec.decode(codec.encode(message))


@pytest.mark.parametrize(
    "data",
    [b"", b"\x92\xa0", b"\x92\xa0\x01", b"\x92\xa7unknown\x90", b"\x92\xa1*\x91\x01", b"\xff"],
)
def test_malformed_batch_is_a_codec_error(data: bytes) -> None:
    with pytest.raises(codec.CodecError):
        codec.decode_many(data)


def test_unencodable_batch_item_is_a_codec_error() -> None:
    with pytest.raises(codec.CodecError, match="register it"):
        codec.encode_many([1, object()])
    with pytest.raises(codec.CodecError, match="register it"):
        codec.encode_many([EngineOutput(), object()])


def test_reserved_tag() -> None:
    with pytest.raises(codec.CodecError, match="reserved"):
        codec.register(Usage, "*")


def test_message_header() -> None:
    data = f.message(f.ASK, 2**40 + 5, b"body")
    kind, corr, body = f.parse(data)
    assert (kind, corr, bytes(body)) == (f.ASK, 2**40 + 5, b"body")
    assert f.parse_count(memoryview(f.count(256))) == 256


class _Received(list[tuple[int, int, bytes]]):
    """What a link delivered: (kind, corr, body), the body copied (the link reuses its view)."""

    def __call__(self, kind: int, corr: int, body: memoryview) -> None:
        self.append((kind, corr, bytes(body)))


@transports
async def test_link_keeps_what_is_sent_before_the_peer_connects(transport: Transport) -> None:
    up, down = _Received(), _Received()
    parent = new_link(transport, up)
    endpoints = parent.bind(f"test-link-{os.getpid()}")
    child = None
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(parent.run)
            for i in range(5):
                parent.send(f.TELL, i, bytes([i]))  # nobody has connected: the link keeps it
            await anyio.sleep(0.01)
            child = connect_link(endpoints, down)
            tg.start_soon(child.run)
            child.send(f.REPLY, 2**64 - 1, b"up")
            with anyio.fail_after(10):
                while len(down) < 5 or not up:
                    await anyio.sleep(0.005)
            parent.close()  # run() returns once its link is closed
            child.close()
    finally:
        parent.close()
        if child is not None:
            child.close()
    assert down == [(f.TELL, i, bytes([i])) for i in range(5)]
    assert up == [(f.REPLY, 2**64 - 1, b"up")]
    with pytest.raises(LinkBroken):
        parent.send(f.TELL, 0, b"late")
    assert not _files_of(endpoints)


@transports
async def test_link_carries_bursts_of_every_size_in_order(transport: Transport) -> None:
    # Frame sizes around the unix link's 256 KiB read buffer and 16 KiB copy threshold (a frame
    # is the body, a 9-byte header and a 4-byte length), sent in one burst (more than the socket
    # buffers hold) so frames split across reads and the backlog is used.
    frames = [13, 14, 22, 16383, 16384, 65536, 262_139, 262_140, 262_144, 262_145, 1_000_000]
    sizes = [n - 13 for n in frames] * 3 + [17] * 5000 + [16 * 1024 * 1024, 5]
    messages = [(i % 256, i, os.urandom(n)) for i, n in enumerate(sizes)]
    async with _linked_pair(transport) as pair:
        for message in messages:
            pair.parent.send(*message)
        with anyio.fail_after(30):
            while len(pair.down) < len(messages):
                await anyio.sleep(0.005)
    assert pair.down == messages


@pytest.mark.parametrize("how", ["shutdown", "close"])
async def test_peer_closing_its_unix_link_breaks_the_link(how: str) -> None:
    async with _linked_pair("unix") as pair:
        pair.child.send(f.EXIT, 0, b"last words")
        if how == "shutdown":  # under the link's feet, as a fault would
            with socket.socket(fileno=os.dup(pair.child._fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        else:
            pair.child.close()
        with anyio.fail_after(5):
            while "parent" not in pair.errors:
                await anyio.sleep(0.005)
        assert "closed" in str(pair.errors["parent"])
        # What it sent before it closed is delivered.
        assert pair.up == [(f.EXIT, 0, b"last words")]
        assert pair.parent.broken and pair.parent.peer_closed
        pair.parent.send(f.TELL)  # a broken link drops what is sent: run() raised
        pair.parent.close()
        with pytest.raises(LinkBroken):
            pair.parent.send(f.TELL)


async def test_send_to_a_closed_peer_breaks_the_unix_link() -> None:
    async with _linked_pair("unix") as pair:
        with anyio.fail_after(5):
            while pair.parent._fd < 0:  # accepted
                await anyio.sleep(0.005)
        pair.child.close()
        pair.parent.send(f.TELL, 0, b"x" * 100)  # EPIPE: the peer's end is gone
        assert pair.parent.broken
        with anyio.fail_after(5):
            while "parent" not in pair.errors:
                await anyio.sleep(0.005)


@transports
async def test_draining_a_link_before_its_peer_is_accepted_loses_nothing(
    transport: Transport,
) -> None:
    # A child that fails at start connects, sends START_FAILED and exits: the parent's process
    # watcher drains the link at once, maybe before the link's task accepted the connection.
    up = _Received()
    parent = new_link(transport, up)
    endpoints = parent.bind(f"test-early-{os.getpid()}")
    child = connect_link(endpoints, _Received())
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(child.run)
            child.send(f.TELL, 7, b"first words")
            await anyio.sleep(0.01)
            parent.drain()  # not accepted yet: nothing to read, and no error
            tg.start_soon(parent.run)
            with anyio.fail_after(10):
                while not up:
                    await anyio.sleep(0.005)
                    parent.drain()
            parent.close()
            child.close()
    finally:
        parent.close()
        child.close()
    assert up == [(f.TELL, 7, b"first words")]


async def test_unix_link_closed_before_its_peer_connects() -> None:
    parent = new_link("unix", _Received())
    endpoints = parent.bind("test-unconnected")
    assert _files_of(endpoints)
    async with anyio.create_task_group() as tg:
        tg.start_soon(parent.run)
        await anyio.sleep(0.01)
        parent.close()  # the waiting accept ends, run() returns
    assert not _files_of(endpoints)
    with pytest.raises(LinkBroken, match="cannot connect"):
        connect_link(endpoints, _Received())


class _Pair:
    """A parent link and the child link connected to it, what each received, and the
    ``LinkBroken`` each one's ``run()`` raised."""

    def __init__(self, transport: Transport) -> None:
        self.up, self.down = _Received(), _Received()
        self.errors: dict[str, LinkBroken] = {}
        self.parent = new_link(transport, self.up)
        self.endpoints = self.parent.bind(f"test-pair-{os.getpid()}")
        self.child = connect_link(self.endpoints, self.down)

    async def run(self, name: str, link: Link) -> None:
        try:
            await link.run()
        except LinkBroken as exc:
            self.errors[name] = exc


@asynccontextmanager
async def _linked_pair(transport: Transport) -> AsyncIterator[_Pair]:
    pair = _Pair(transport)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pair.run, "parent", pair.parent)
            tg.start_soon(pair.run, "child", pair.child)
            yield pair
            tg.cancel_scope.cancel()
    finally:
        pair.parent.close()
        pair.child.close()
    assert not _files_of(pair.endpoints)


def _files_of(endpoints: list[str]) -> list[str]:
    """The socket files (and the unix link's directory) of these endpoints still there."""
    paths = [e.split("://", 1)[1] for e in endpoints if not e.startswith("tcp://")]
    paths += [os.path.dirname(e[len("unix://") :]) for e in endpoints if e.startswith("unix://")]
    return [p for p in paths if os.path.exists(p)]
