"""The root's local control socket: ``actorserve tree`` asks a running root for its tree.

A ZMQ REP socket on an ``ipc://`` path owned by the root (never a network address); requests and
replies are msgpack.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any

import anyio
import attrs
import msgspec
import zmq

from actors import Actor
from actors.lowlevel import AsyncSocket
from supervisors import SupervisorRef, TreeNode, snapshot_tree

__all__ = ["ControlServer", "default_control_path", "request_tree"]


def default_control_path() -> str:
    return os.path.join(tempfile.gettempdir(), f"actorserve-{os.getuid()}.ctl")


class ControlServer(Actor):
    """Answers ``{"op": "tree"}`` with the live tree of ``root``."""

    def __init__(self, root: SupervisorRef, path: str) -> None:
        self.root = root
        self.path = path

    async def started(self) -> None:
        self.socket = AsyncSocket.create(zmq.REP)
        self.socket.bind(f"ipc://{self.path}")
        self.start_soon(self._serve)

    async def stopping(self, reason: Any) -> None:
        self.socket.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # ZMQ leaves the ipc file of a closed socket behind

    async def _serve(self) -> None:
        try:
            while True:
                request = msgspec.msgpack.decode((await self.socket.recv_multipart())[0])
                if isinstance(request, dict) and request.get("op") == "tree":
                    reply: Any = attrs.asdict(await snapshot_tree(self.root))
                else:
                    reply = {"error": f"unknown request {request!r}"}
                await self.socket.send_multipart([msgspec.msgpack.encode(reply)])
        finally:
            self.socket.close()


async def request_tree(path: str, timeout: float = 5.0) -> TreeNode:
    """The live tree of the root listening on ``path``."""
    sock = AsyncSocket.create(zmq.REQ)
    try:
        sock.connect(f"ipc://{path}")
        with anyio.fail_after(timeout):
            await sock.send_multipart([msgspec.msgpack.encode({"op": "tree"})])
            data = msgspec.msgpack.decode((await sock.recv_multipart())[0])
    finally:
        sock.close()
    if "error" in data:
        raise RuntimeError(data["error"])
    return _node(data)


def _node(data: dict[str, Any]) -> TreeNode:
    return TreeNode(**{**data, "children": tuple(_node(c) for c in data["children"])})
