"""The wire format of process actors: codec batches and message headers (no processes)."""

from __future__ import annotations

from typing import Any

import pytest

from actors.process import _frames as f
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
