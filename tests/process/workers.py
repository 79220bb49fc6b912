"""Actors the process tests run in child processes (importable by path)."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import sniffio

from actors import Actor, ReplyError
from protocols import codec


@codec.register
class Kept(msgspec.Struct):
    """Decoded into fields that point into the bytes it was decoded from (msgspec's zero-copy
    types): kept after its message, it shows whether a link reused those bytes."""

    raw: msgspec.Raw
    view: memoryview

    def contents(self) -> tuple[bytes, bytes]:
        return bytes(self.raw), bytes(self.view)


class Echo(Actor):
    def __init__(self, greeting: str = "hello") -> None:
        self.greeting = greeting
        self.told: list[Any] = []
        self.aborted = 0
        self.stream_closed = 0
        self.produced = 0
        self.kept: list[Kept] = []

    async def receive(self, message: Any) -> Any:
        match message:
            case "pid":
                return os.getpid()
            case "loop":  # the event loop: asyncio, uvloop (ours is uvloop's, subclassed) or trio
                if sniffio.current_async_library() == "trio":
                    return "trio"
                modules = (cls.__module__ for cls in type(asyncio.get_running_loop()).__mro__)
                return "uvloop" if any(m.startswith("uvloop") for m in modules) else "asyncio"
            case "greeting":
                return self.greeting
            case "told":
                return self.told
            case ("sleep", seconds):
                try:
                    await anyio.sleep(seconds)
                except anyio.get_cancelled_exc_class():
                    self.aborted += 1
                    raise
                return "slept"
            case "aborted":
                return self.aborted
            case "stream_closed":
                return self.stream_closed
            case "produced":
                return self.produced
            case Kept():
                self.kept.append(message)
                return message
            case "kept":
                return [kept.contents() for kept in self.kept]
            case "reply-error":
                raise ReplyError("no such thing")
            case "crash":
                raise RuntimeError("handler blew up")
            case "exit":
                os._exit(3)
            case ("echo", value):
                return value
            case ("block", seconds):
                time.sleep(seconds)  # noqa: ASYNC251 (blocks the loop: the link is not read)
                return "blocked"
            case ("break-link", stall):
                _shut_link_socket()
                time.sleep(stall)  # noqa: ASYNC251 (blocks the loop: no reaction meanwhile)
                return None
            case ("tell", value):
                self.told.append(value)
                return None
            case bytes() as blob:
                return len(blob)
            case _:
                return message

    async def receive_stream(self, message: Any) -> AsyncIterator[Any]:
        match message:
            case ("count", n):
                for i in range(n):
                    yield i
            case ("chunks", n, size):
                chunk = list(range(size))
                for _ in range(n):
                    yield chunk
            case ("forever",):
                i = 0
                try:
                    while True:
                        yield i
                        i += 1
                        await anyio.sleep(0.001)
                finally:
                    self.stream_closed += 1
            case ("fail-after", n):
                for i in range(n):
                    yield i
                raise ReplyError("stream failed")
            case ("counted", n):
                for i in range(n):
                    self.produced += 1
                    yield i
            case ("unencodable-after", n):
                for i in range(n):
                    yield i
                    await anyio.lowlevel.checkpoint()
                yield object()
            case _:
                raise ReplyError(f"unknown stream {message!r}")


def _shut_link_socket() -> None:
    """Shut down this process's end of its unix link (the socket connected to the parent's
    ``actorserve-*`` socket file), under the link's feet."""
    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue  # not a socket
        with sock:
            if sock.family == socket.AF_UNIX and "actorserve-" in str(sock.getpeername()):
                sock.shutdown(socket.SHUT_RDWR)
                return
    raise RuntimeError("no unix link socket in this process")


class FailsToStart(Actor):
    async def started(self) -> None:
        raise RuntimeError("cannot start")


class HangsBeforeConnecting(Actor):
    def __init__(self) -> None:
        time.sleep(30)  # built before the child connects to its parent


class ExitsDuringStart(Actor):
    async def started(self) -> None:
        os._exit(7)


class FlakyStart(Actor):
    """Fails its first ``failures`` starts (counted in a file, across processes)."""

    def __init__(self, counter_path: str, failures: int) -> None:
        self.counter_path = counter_path
        self.failures = failures

    async def started(self) -> None:
        path = anyio.Path(self.counter_path)
        count = int(await path.read_text()) if await path.exists() else 0
        await path.write_text(str(count + 1))
        if count < self.failures:
            raise RuntimeError(f"start attempt {count + 1} fails")

    async def receive(self, message: Any) -> Any:
        return os.getpid() if message == "pid" else message
