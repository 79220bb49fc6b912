"""The wire of process actors: codec batches, message headers, the link (no processes)."""

from __future__ import annotations

import os
from typing import Any

import anyio
import pytest

from actors.process import _frames as f
from actors.process._link import Link, LinkBroken, new_endpoints
from protocols import codec
from protocols.control import Abort, Pause  # attrs classes
from protocols.engine import EngineOutput, PauseMode, Usage


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


async def test_link_keeps_what_is_sent_before_the_peer_connects() -> None:
    up: list[bytes] = []
    down: list[bytes] = []
    parent, child = Link(up.append), Link(down.append)
    parent_rx, parent_tx = parent.bind(*new_endpoints("ipc", f"test-link-{os.getpid()}"))
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(parent.run)
            tg.start_soon(child.run)
            for i in range(5):
                parent.send(bytes([i]))  # nobody has connected: ZMQ refuses, the link keeps it
            child.connect(parent_tx, parent_rx)
            child.send(b"up")
            with anyio.fail_after(10):
                while len(down) < 5 or not up:
                    await anyio.sleep(0.005)
            parent.close()  # run() returns once its link is closed
            child.close()
    finally:
        parent.close()
        child.close()
    assert down == [bytes([i]) for i in range(5)]
    assert up == [b"up"]
    with pytest.raises(LinkBroken):
        parent.send(b"late")
