"""The root's local control socket: ``actorserve tree`` asks a running root for its tree, and
``actorserve workers`` (and the other control commands) where its control API listens.

A Unix stream socket in the root's private run directory (never a network address), mode 0600;
one msgpack request and one msgpack reply per connection, each behind a 4-byte length. The accept
loop is ours so that running out of descriptors (a flood of HTTP connections, say) pauses it for
a moment instead of ending it: a listener that aborts on EMFILE would take the root with it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
from typing import Any

import anyio
import anyio.abc
import attrs
import msgspec
import structlog

from actors import Actor, ActorError
from actors.serving.root._rundir import RunDirError, live_control_sockets
from supervisors import SupervisorRef, TreeNode, snapshot_tree

__all__ = ["ControlServer", "find_control_socket", "request_control_api", "request_tree"]

_MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL
_MAX_MESSAGE = 1 << 20
_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_log = structlog.get_logger("actorserve.control")


def find_control_socket() -> str:
    """The control socket of this user's one running root."""
    sockets = live_control_sockets()
    if not sockets:
        raise RunDirError("no running root of this user (start one with `actorserve run`)")
    if len(sockets) > 1:
        named = ", ".join(str(s) for s in sockets)
        raise RunDirError(f"several roots are running; name one with --control: {named}")
    return str(sockets[0])


async def _send(stream: anyio.abc.ByteStream, message: Any) -> None:
    data = msgspec.msgpack.encode(message)
    await stream.send(struct.pack(">I", len(data)) + data)


async def _receive(stream: anyio.abc.ByteReceiveStream) -> Any:
    buffer = b""
    size: int | None = None
    while size is None or len(buffer) < 4 + size:
        chunk = await stream.receive()
        buffer += chunk
        if size is None and len(buffer) >= 4:
            size = struct.unpack(">I", buffer[:4])[0]
            if size > _MAX_MESSAGE:
                raise ValueError(f"control message of {size} bytes")
    return msgspec.msgpack.decode(buffer[4 : 4 + size])


class ControlServer(Actor):
    """Answers ``{"op": "tree"}`` with the live tree of ``root``, and ``{"op": "control_api"}``
    with the URL of its control API (served on ``api_host`` by the ``control-api`` child) and the
    file of the token the root made (``None`` when it was given one)."""

    def __init__(
        self,
        root: SupervisorRef,
        path: str,
        api_host: str | None = None,
        token_file: str | None = None,
    ) -> None:
        self.root = root
        self.path = path
        self.api_host = api_host
        self.token_file = token_file

    async def started(self) -> None:
        if len(os.fsencode(self.path)) > _MAX_SOCKET_PATH:
            raise RunDirError(f"{self.path}: too long for a Unix socket (name a shorter --control)")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a socket file left by a root of a reused pid
        self.listener = await anyio.create_unix_listener(self.path, mode=0o600)
        self.start_soon(self._accept)

    async def stopping(self, reason: Any) -> None:
        await self.listener.aclose()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    async def _accept(self) -> None:
        starved = False  # one warning per stretch without descriptors, not one per retry
        async with anyio.create_task_group() as tg:
            while True:
                try:
                    stream = await self.listener.accept()
                except (OSError, anyio.BrokenResourceError) as exc:
                    # anyio reports a failed accept as BrokenResourceError from the OSError.
                    cause = exc if isinstance(exc, OSError) else exc.__cause__
                    if not isinstance(cause, OSError) or cause.errno not in _OUT_OF_DESCRIPTORS:
                        raise
                    if not starved:
                        _log.warning("control socket: out of descriptors, pausing accepts")
                        starved = True
                    await anyio.sleep(0.1)
                    continue
                if starved:
                    _log.warning("control socket: accepting again")
                    starved = False
                tg.start_soon(self._answer, stream)

    async def _answer(self, stream: anyio.abc.ByteStream) -> None:
        async with stream:
            try:
                with anyio.fail_after(10):
                    request = await _receive(stream)
                    op = request.get("op") if isinstance(request, dict) else None
                    if op == "tree":
                        reply: Any = attrs.asdict(await snapshot_tree(self.root))
                    elif op == "control_api":
                        reply = await self._control_api()
                    else:
                        reply = {"error": f"unknown request {request!r}"}
                    await _send(stream, reply)
            except (
                TimeoutError,
                ValueError,
                msgspec.DecodeError,
                anyio.EndOfStream,
                anyio.BrokenResourceError,
            ) as exc:
                _log.info("control socket: request dropped", reason=repr(exc))

    async def _control_api(self) -> dict[str, Any]:
        if self.api_host is None:
            return {"error": "this root serves no control API (run it with --control-api-port)"}
        try:
            port = await (await self.root.child("control-api")).ask("port")
        except (KeyError, ActorError) as exc:  # the API is restarting: the client may try again
            return {"error": f"the control API is not running: {exc!r}"}
        host = f"[{self.api_host}]" if ":" in self.api_host else self.api_host
        return {"url": f"http://{host}:{port}", "token_file": self.token_file}


async def _request(path: str, op: str, timeout: float) -> Any:
    with anyio.fail_after(timeout):
        async with await anyio.connect_unix(path) as stream:
            await _send(stream, {"op": op})
            data = await _receive(stream)
    if "error" in data:
        raise RuntimeError(data["error"])
    return data


async def request_tree(path: str, timeout: float = 5.0) -> TreeNode:
    """The live tree of the root listening on ``path``."""
    return _node(await _request(path, "tree", timeout))


async def request_control_api(path: str, timeout: float = 5.0) -> tuple[str, str | None]:
    """The URL of the control API of the root listening on ``path``, and the file of the token
    the root made (``None``: it was given its token)."""
    data = await _request(path, "control_api", timeout)
    return str(data["url"]), data["token_file"]


def _node(data: dict[str, Any]) -> TreeNode:
    return TreeNode(**{**data, "children": tuple(_node(c) for c in data["children"])})
