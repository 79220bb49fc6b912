"""The pickle-free wire codec for messages that cross a process (or host) boundary.

A message is encoded as ``[tag, payload]`` in msgpack. Plain data (None, bool, numbers, str,
bytes, lists, dicts) has the empty tag. ``msgspec.Struct`` types (the hot path: engine requests
and outputs) and ``attrs`` classes (control messages, structured by cattrs) must be registered
with :func:`register`; the tag is their registered name, so decoding never imports arbitrary code.
Errors travel as ``(tag, message)``, or as a registered family's stable code (the request errors
of :mod:`protocols.errors`), and come back as the same type. Message modules register their own
types (:mod:`protocols.engine` its structs, :mod:`protocols.errors` its family), so the codec,
which the actor runtime uses for every process actor, knows no engine message.

A batch (:func:`encode_many`, a stream's items) is ``[tag, [payload, ...]]`` when every item has
the same tag, so the whole batch is one msgspec call each way; a mixed batch is ``["*", [message,
...]]``. Token ids stay msgpack integers: in a batch that is 1-3 bytes per id below 65536, more
compact than packed int32, and it decodes as fast as unpacking packed bytes into a list.

The codec's own errors, under one root (the request errors, which cross as their family's codes,
have their own tree in :mod:`protocols.errors`)::

    ProtocolError ..................... a message or an error did not cross as itself
        CodecError .................... it could not be encoded or decoded; a ValueError too
        RemoteError ................... an error of the other side whose type is not registered
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import cattrs.preconf.msgspec
import msgspec

__all__ = [
    "CodecError",
    "ProtocolError",
    "RemoteError",
    "decode",
    "decode_error",
    "decode_many",
    "encode",
    "encode_error",
    "encode_many",
    "register",
    "register_error",
    "register_error_family",
]

T = TypeVar("T", bound=type)
E = TypeVar("E", bound=BaseException)

_encoder = msgspec.msgpack.Encoder()
_envelope = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
_plain = msgspec.msgpack.Decoder()
_batch = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
_mixed = msgspec.msgpack.Decoder(list[msgspec.Raw])
# Plain data starts with a 2-array whose tag is the empty string (checked byte by byte: slicing
# a view makes another).
_PAIR, _PLAIN_TAG = 0x92, 0xA0
_MIXED = "*"  # the tag of a mixed batch (no registered type may use it)
_converter = cattrs.preconf.msgspec.make_converter()

_by_tag: dict[str, type] = {}
_tag_of: dict[type, str] = {}
_decoders: dict[type, msgspec.msgpack.Decoder[Any]] = {}
_batch_decoders: dict[str, Callable[[msgspec.Raw], list[Any]]] = {}
_errors_by_tag: dict[str, type[BaseException]] = {}
_ToWire = Callable[[Any], tuple[str, str]]
_FromWire = Callable[[str, str], BaseException]
_families: dict[str, tuple[type[BaseException], _ToWire, _FromWire]] = {}  # by family name


class ProtocolError(Exception):
    """Base of the codec's errors: a message or an error that did not cross the wire as itself."""


class CodecError(ProtocolError, ValueError):
    """A message could not be encoded or decoded (unregistered type, malformed bytes)."""


class RemoteError(ProtocolError):
    """An error from the other side whose type is not registered here."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message


def register(cls: T, tag: str | None = None) -> T:
    """Allow ``cls`` (a msgspec Struct, an attrs class or an Enum) on the wire under ``tag``."""
    name = tag or f"{cls.__module__}.{cls.__qualname__}"
    if name == _MIXED:
        raise CodecError(f"tag {_MIXED!r} is reserved")
    if _by_tag.get(name, cls) is not cls:
        raise CodecError(f"tag {name!r} already names {_by_tag[name]!r}")
    if not (issubclass(cls, msgspec.Struct | enum.Enum) or attrs.has(cls)):
        raise CodecError(f"{cls!r} is neither a msgspec Struct, an Enum nor an attrs class")
    _by_tag[name] = cls
    _tag_of[cls] = name
    return cls


def register_error(cls: type[BaseException], tag: str | None = None) -> None:
    """Let an exception type cross as itself; it must take the message as its only argument."""
    _errors_by_tag[tag or f"{cls.__module__}.{cls.__qualname__}"] = cls


def encode(message: Any) -> bytes:
    # One encoder call: ``(tag, message)`` gives the same bytes as ``(tag, Raw(payload))``.
    cls = type(message)
    tag = _tag_of.get(cls)
    try:
        if tag is None:
            return _encoder.encode(("", message))
        if issubclass(cls, msgspec.Struct | enum.Enum):
            return _encoder.encode((tag, message))
        return _encoder.encode((tag, _converter.unstructure(message)))
    except TypeError as exc:
        raise _unencodable(cls.__name__, exc) from None


def decode(data: bytes | bytearray | memoryview) -> Any:
    try:
        if data[1] == _PLAIN_TAG and data[0] == _PAIR:
            return _plain.decode(data)[1]  # plain data: one decoder call
        tag, raw = _envelope.decode(data)
        if not tag:
            return _plain.decode(raw)
        return _payload_decoder(tag)(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, IndexError) as exc:
        raise CodecError(f"malformed message: {exc}") from None


def encode_many(messages: list[Any]) -> bytes:
    """A batch of messages as one blob (see the module docstring)."""
    types = set(map(type, messages))
    tags = {_tag_of.get(cls) for cls in types}
    if len(tags) <= 1:
        tag = tags.pop() if tags else None
        if tag is None or issubclass(_by_tag[tag], msgspec.Struct | enum.Enum):
            body: Any = messages
        else:
            body = [_converter.unstructure(m) for m in messages]
        try:
            return _encoder.encode((tag or "", body))
        except TypeError as exc:
            raise _unencodable("a batch item", exc) from None
    return _encoder.encode((_MIXED, [msgspec.Raw(encode(m)) for m in messages]))


def decode_many(data: bytes | bytearray | memoryview) -> list[Any]:
    """The messages of an :func:`encode_many` blob."""
    try:
        if data[1] == _PLAIN_TAG and data[0] == _PAIR:
            messages = _plain.decode(data)[1]
            if not isinstance(messages, list):
                raise CodecError("malformed batch: not a list")
            return messages
        tag, raw = _batch.decode(data)
        decode_items = _batch_decoders.get(tag)
        if decode_items is None:
            decode_items = _batch_decoder(tag)
        decoded: list[Any] = decode_items(raw)
        return decoded
    except (msgspec.DecodeError, msgspec.ValidationError, IndexError) as exc:
        raise CodecError(f"malformed batch: {exc}") from None


def _batch_decoder(tag: str) -> Callable[[msgspec.Raw], list[Any]]:
    """How a batch of ``tag`` items decodes (kept per tag: a stream's batches share theirs)."""
    decoder: Callable[[msgspec.Raw], list[Any]]
    cls = _by_tag.get(tag)
    if tag == _MIXED:
        decoder = lambda raw: [decode(memoryview(item)) for item in _mixed.decode(raw)]  # noqa: E731
    elif cls is None:
        raise CodecError(f"unknown message tag {tag!r}")
    elif issubclass(cls, msgspec.Struct | enum.Enum):
        decoder = msgspec.msgpack.Decoder(list[cls]).decode  # type: ignore[valid-type]
    else:
        decoder = lambda raw: [_converter.structure(m, cls) for m in _plain_list(raw)]  # noqa: E731
    _batch_decoders[tag] = decoder
    return decoder


def _payload_decoder(tag: str) -> Any:
    cls = _by_tag.get(tag)
    if cls is None:
        raise CodecError(f"unknown message tag {tag!r}")
    if issubclass(cls, msgspec.Struct | enum.Enum):
        decoder = _decoders.get(cls)
        if decoder is None:
            decoder = _decoders[cls] = msgspec.msgpack.Decoder(cls)
        return decoder.decode
    return lambda raw: _converter.structure(_plain.decode(raw), cls)


def _plain_list(raw: msgspec.Raw) -> list[Any]:
    messages = _plain.decode(raw)
    if not isinstance(messages, list):
        raise CodecError("malformed batch: not a list")
    return messages


def _unencodable(what: str, exc: Exception) -> CodecError:
    return CodecError(f"cannot encode {what}: {exc} (register it with protocols.codec.register)")


def register_error_family(
    name: str,
    base: type[E],
    to_wire: Callable[[E], tuple[str, str]],
    from_wire: Callable[[str, str], BaseException],
) -> None:
    """Send every ``base`` error as its stable ``(code, message)`` under ``name``; the receiver
    rebuilds it with ``from_wire``."""
    _families[name] = (base, to_wire, from_wire)


def encode_error(error: BaseException) -> bytes:
    for family, (base, to_wire, _) in _families.items():
        if isinstance(error, base):
            code, message = to_wire(error)
            return _encoder.encode((family, code, message))
    tag = next((t for t, c in _errors_by_tag.items() if type(error) is c), "")
    name = tag or f"{type(error).__module__}.{type(error).__qualname__}"
    return _encoder.encode(("error", name, str(error)))


def decode_error(data: bytes | bytearray | memoryview) -> BaseException:
    try:
        kind, name, message = _plain.decode(data)
    except (msgspec.DecodeError, ValueError) as exc:
        return CodecError(f"malformed error: {exc}")
    family = _families.get(kind)
    if family is not None:
        return family[2](name, message)
    cls = _errors_by_tag.get(name)
    if cls is not None:
        return cls(message)
    return RemoteError(name, message)


register_error(CodecError, "codec.CodecError")  # a message the other side could not encode
