"""The pickle-free wire codec for messages that cross a process (or host) boundary.

A message is encoded as ``[tag, payload]`` in msgpack. Plain data (None, bool, numbers, str,
bytes, lists, dicts) has the empty tag. ``msgspec.Struct`` types (the hot path: engine requests
and outputs) and ``attrs`` classes (control messages, structured by cattrs) must be registered
with :func:`register`; the tag is their registered name, so decoding never imports arbitrary code.
Errors travel as ``(tag, message)`` or, for :class:`~protocols.errors.RequestError`, as their
stable code, and come back as the same type.
"""

from __future__ import annotations

import enum
from typing import Any, TypeVar

import attrs
import cattrs.preconf.msgspec
import msgspec

from protocols import engine as _engine
from protocols import errors as _errors

__all__ = [
    "CodecError",
    "RemoteError",
    "decode",
    "decode_error",
    "encode",
    "encode_error",
    "register",
    "register_error",
]

T = TypeVar("T", bound=type)

_encoder = msgspec.msgpack.Encoder()
_envelope = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
_plain = msgspec.msgpack.Decoder()
_converter = cattrs.preconf.msgspec.make_converter()

_by_tag: dict[str, type] = {}
_tag_of: dict[type, str] = {}
_decoders: dict[type, msgspec.msgpack.Decoder[Any]] = {}
_errors_by_tag: dict[str, type[BaseException]] = {}


class CodecError(ValueError):
    """A message could not be encoded or decoded (unregistered type, malformed bytes)."""


class RemoteError(Exception):
    """An error from the other side whose type is not registered here."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message


def register(cls: T, tag: str | None = None) -> T:
    """Allow ``cls`` (a msgspec Struct, an attrs class or an Enum) on the wire under ``tag``."""
    name = tag or f"{cls.__module__}.{cls.__qualname__}"
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
    cls = type(message)
    tag = _tag_of.get(cls)
    try:
        if tag is None:
            return _encoder.encode(("", msgspec.Raw(_encoder.encode(message))))
        if issubclass(cls, msgspec.Struct | enum.Enum):
            return _encoder.encode((tag, msgspec.Raw(_encoder.encode(message))))
        return _encoder.encode((tag, msgspec.Raw(_encoder.encode(_converter.unstructure(message)))))
    except TypeError as exc:
        raise CodecError(
            f"cannot encode {cls.__name__}: {exc} (register it with protocols.codec.register)"
        ) from None


def decode(data: bytes | memoryview) -> Any:
    try:
        tag, raw = _envelope.decode(data)
        if not tag:
            return _plain.decode(raw)
        cls = _by_tag.get(tag)
        if cls is None:
            raise CodecError(f"unknown message tag {tag!r}")
        if issubclass(cls, msgspec.Struct | enum.Enum):
            decoder = _decoders.get(cls)
            if decoder is None:
                decoder = _decoders[cls] = msgspec.msgpack.Decoder(cls)
            return decoder.decode(raw)
        return _converter.structure(_plain.decode(raw), cls)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CodecError(f"malformed message: {exc}") from None


def encode_error(error: BaseException) -> bytes:
    if isinstance(error, _errors.RequestError):
        code, message = error.to_wire()
        return _encoder.encode(("request", code, message))
    tag = next((t for t, c in _errors_by_tag.items() if type(error) is c), "")
    name = tag or f"{type(error).__module__}.{type(error).__qualname__}"
    return _encoder.encode(("error", name, str(error)))


def decode_error(data: bytes | memoryview) -> BaseException:
    try:
        kind, name, message = _plain.decode(data)
    except (msgspec.DecodeError, ValueError) as exc:
        return CodecError(f"malformed error: {exc}")
    if kind == "request":
        return _errors.error_from_wire(name, message)
    cls = _errors_by_tag.get(name)
    if cls is not None:
        return cls(message)
    return RemoteError(name, message)


for _cls in (
    _engine.StopConditions,
    _engine.SamplingOptions,
    _engine.BootstrapInfo,
    _engine.RoutingHints,
    _engine.PreprocessedRequest,
    _engine.Usage,
    _engine.EngineOutput,
    _engine.Capacity,
    _engine.PauseMode,
    _engine.MemoryTag,
):
    register(_cls, f"engine.{_cls.__name__}")
