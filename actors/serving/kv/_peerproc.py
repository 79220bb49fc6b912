"""Start a KV peer process (``python -m actors.serving.kv._peer``) and drive it:
:class:`PeerProcess`."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import msgspec
import zmq

from actors.lowlevel import AsyncSocket
from actors.serving.kv._bootstrap import bootstrap_info
from actors.serving.kv._channel import Channel
from actors.serving.kv._peer_protocol import Command, Envelope, Outcome, ReplyEnvelope, Stats, Stop
from protocols.engine import BootstrapInfo

__all__ = ["PeerProcess", "bootstrap_for"]


class PeerProcess:
    """A child KV worker and a client for its control socket. Start with :meth:`start`."""

    def __init__(self, process: anyio.abc.Process, control: AsyncSocket) -> None:
        self.process = process
        self._control = Channel(control, self._on_frames)
        self._ids = itertools.count(1)
        self._killed = False
        self._waiters: dict[int, tuple[anyio.Event, list[Outcome]]] = {}
        self._decoder = msgspec.msgpack.Decoder(ReplyEnvelope)
        self._encoder = msgspec.msgpack.Encoder()

    @property
    def pid(self) -> int:
        return self.process.pid

    @classmethod
    @asynccontextmanager
    async def start(
        cls,
        role: str,
        control: str,
        *,
        num_pages: int,
        page_bytes: int,
        device: str = "cpu",
        bootstrap: str = "tcp://127.0.0.1:0",
        worker_id: str | None = None,
        agent_name: str | None = None,
        heartbeat: float = 0.1,
        peer_timeout: float = 1.0,
        poll_while_pending: bool = False,
        threads: int = 0,
        split_min_bytes: int | None = None,
    ) -> AsyncIterator[PeerProcess]:
        """Run a peer; on exit stop it (gracefully, else SIGKILL) and reap it. ``threads`` and
        ``split_min_bytes``: its agent's posting threads and its ``KVConfig`` value."""
        cmd = [
            sys.executable,
            "-m",
            "actors.serving.kv._peer",
            "--role",
            role,
            "--control",
            control,
        ]
        cmd += ["--pages", str(num_pages), "--page-bytes", str(page_bytes), "--device", device]
        cmd += ["--bootstrap", bootstrap, "--heartbeat", str(heartbeat)]
        cmd += ["--peer-timeout", str(peer_timeout)]
        if worker_id:
            cmd += ["--worker-id", worker_id]
        if agent_name:
            cmd += ["--agent-name", agent_name]
        if poll_while_pending:
            cmd += ["--poll-while-pending"]
        cmd += ["--threads", str(threads)]
        if split_min_bytes is not None:
            cmd += ["--split-min-bytes", str(split_min_bytes)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        process = await anyio.open_process(
            cmd, stdin=subprocess.DEVNULL, stdout=None, stderr=None, env=env
        )
        sock = AsyncSocket.create(zmq.DEALER)
        peer = cls(process, sock)
        try:
            sock.connect(control)
            async with anyio.create_task_group() as tg:
                tg.start_soon(peer._control.run)
                try:
                    yield peer
                finally:
                    with anyio.CancelScope(shield=True):
                        await peer._stop()
                    tg.cancel_scope.cancel()
        finally:
            sock.close()
            with anyio.CancelScope(shield=True):
                if process.returncode is None:
                    process.kill()
                await process.wait()

    async def call(self, cmd: Command, timeout: float = 60.0) -> Outcome:
        """Send a command and wait for its reply (``TimeoutError`` after ``timeout``)."""
        request_id = next(self._ids)
        done = anyio.Event()
        box: list[Outcome] = []
        self._waiters[request_id] = (done, box)
        try:
            self._control.send([self._encoder.encode(Envelope(request_id, cmd))])
            with anyio.fail_after(timeout):
                await done.wait()
        finally:
            self._waiters.pop(request_id, None)
        return box[0]

    async def wait_ready(self, timeout: float = 30.0) -> Outcome:
        """The first ``Stats`` reply: the peer's service is up (``endpoint`` is its bootstrap)."""
        return await self.call(Stats(), timeout)

    def kill(self) -> None:
        """SIGKILL the peer (a real fault, for tests)."""
        self._killed = True
        os.kill(self.process.pid, signal.SIGKILL)

    def _on_frames(self, frames: list[bytes]) -> None:
        env = self._decoder.decode(frames[-1])
        waiter = self._waiters.get(env.id)
        if waiter is not None:
            waiter[1].append(env.body)
            waiter[0].set()

    async def _stop(self) -> None:
        if self._killed or self.process.returncode is not None:
            return
        with anyio.move_on_after(5.0):
            await self.call(Stop(), timeout=5.0)
            await self.process.wait()


def bootstrap_for(outcome: Outcome, room: int) -> BootstrapInfo:
    """The bootstrap triple of ``room`` at the prefill peer whose ``Outcome`` named its endpoint."""
    return bootstrap_info(outcome.endpoint, room)
