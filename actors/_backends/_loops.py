"""Which event loop a process of ours runs on: ``asyncio``, ``trio``, or ``uvloop`` (asyncio on
uvloop's loop, through anyio's own option)."""

from __future__ import annotations

import importlib.util
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

import anyio

__all__ = ["Loop", "default_loop", "run_on"]

Loop = Literal["asyncio", "trio", "uvloop"]
T = TypeVar("T")


def default_loop() -> Literal["asyncio", "uvloop"]:
    """``"uvloop"`` where uvloop is installed, else ``"asyncio"``: the event loop a serving
    tree's workers and ``actorserve run``'s root use unless told otherwise."""
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def run_on(loop: str, func: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``anyio.run(func, *args)`` on ``loop``."""
    if loop == "uvloop":
        from actors._backends._uvloop import Loop  # here: uvloop is an optional extra

        options = {"loop_factory": Loop}
        return anyio.run(func, *args, backend="asyncio", backend_options=options)
    return anyio.run(func, *args, backend=loop)
