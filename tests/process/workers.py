"""Actors the process tests run in child processes (importable by path)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

import anyio

from actors import Actor, ReplyError


class Echo(Actor):
    def __init__(self, greeting: str = "hello") -> None:
        self.greeting = greeting
        self.told: list[Any] = []

    async def receive(self, message: Any) -> Any:
        match message:
            case "pid":
                return os.getpid()
            case "greeting":
                return self.greeting
            case "told":
                return self.told
            case ("sleep", seconds):
                await anyio.sleep(seconds)
                return "slept"
            case "reply-error":
                raise ReplyError("no such thing")
            case "crash":
                raise RuntimeError("handler blew up")
            case "exit":
                os._exit(3)
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
                while True:
                    yield i
                    i += 1
                    await anyio.sleep(0.001)
            case ("fail-after", n):
                for i in range(n):
                    yield i
                raise ReplyError("stream failed")
            case _:
                raise ReplyError(f"unknown stream {message!r}")


class FailsToStart(Actor):
    async def started(self) -> None:
        raise RuntimeError("cannot start")


class ExitsDuringStart(Actor):
    async def started(self) -> None:
        os._exit(7)
