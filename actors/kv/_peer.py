"""A KV worker in its own OS process, driven over ZMQ: the other end for tests and benchmarks.

``python -m actors.kv._peer --role prefill|decode --control ipc://...`` runs a
:class:`~actors.kv.PrefillKV` or :class:`~actors.kv.DecodeKV` over its own NIXL agent and pool
and obeys typed commands (msgspec, no pickle) on a control socket it binds.
:class:`PeerProcess` starts one and talks to it. Page contents come from :func:`fill_pattern`: a
deterministic function of ``(seed, position in the request)``, so either side can check bytes.
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import Any

import anyio
import anyio.abc
import msgspec
import numpy as np
import numpy.typing as npt
import zmq

from actors._zmq import AsyncSocket
from actors.kv._bootstrap import KVConfig, bootstrap_info, unpack_pages
from actors.kv._channel import Channel
from actors.kv._decode import DecodeKV
from actors.kv._nixl import NixlAgent
from actors.kv._pool import KVPool, PageAllocation
from actors.kv._prefill import PrefillKV
from actors.kv._room import PrefillRoom
from protocols.engine import BootstrapInfo
from protocols.errors import RequestError

__all__ = ["Outcome", "PeerProcess", "bootstrap_for", "fill_pattern", "pattern_pages"]

_GOLDEN = 0x9E3779B97F4A7C15


# -- commands and replies -------------------------------------------------------------------


class Prefill(msgspec.Struct, tag="prefill", kw_only=True):
    """Open ``room`` now; fill pages with the pattern of ``seed`` and send them (once released,
    if ``hold``). ``pages`` (packed) picks explicit pages, else ``num_pages`` are allocated.
    ``corrupt`` flips a byte of that page *after* its checksum was taken."""

    room: int
    num_pages: int
    seed: int
    pages: bytes = b""
    corrupt: int = -1
    hold: bool = False


class Release(msgspec.Struct, tag="release", kw_only=True):
    room: int


class WaitRoom(msgspec.Struct, tag="wait", kw_only=True):
    """Reply with the room's outcome once it has one."""

    room: int


class Receive(msgspec.Struct, tag="receive", kw_only=True):
    """Decode: receive ``room`` from ``bootstrap`` into fresh pages, check the pattern bytes."""

    bootstrap: BootstrapInfo
    num_pages: int
    seed: int
    pages: bytes = b""
    verify: bool = True
    check_bytes: bool = True
    timeout: float = 30.0


class Connect(msgspec.Struct, tag="connect", kw_only=True):
    endpoint: str


class Stats(msgspec.Struct, tag="stats"):
    pass


class Stop(msgspec.Struct, tag="stop"):
    pass


Command = Prefill | Release | WaitRoom | Receive | Connect | Stats | Stop


class Outcome(msgspec.Struct, kw_only=True):
    """How a room ended on the peer's side (``code`` is a :mod:`protocols.errors` code)."""

    ok: bool
    code: str = ""
    message: str = ""
    nbytes: int = 0
    descriptors: int = 0
    seconds: float = 0.0
    endpoint: str = ""
    info: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)


class _Envelope(msgspec.Struct, array_like=True):
    id: int
    body: Command


class _ReplyEnvelope(msgspec.Struct, array_like=True):
    id: int
    body: Outcome


# -- page contents ----------------------------------------------------------------------------


def pattern_pages(seed: int, count: int, page_bytes: int) -> npt.NDArray[np.uint8]:
    """``count`` pages of deterministic content: page ``k`` of a request depends on (seed, k)."""
    words = page_bytes // 8
    idx = np.arange(words, dtype=np.uint64)
    keys = (np.uint64(seed & 0xFFFFFFFF) << np.uint64(32)) + np.arange(count, dtype=np.uint64)
    grid = (idx[None, :] + keys[:, None] * np.uint64(_GOLDEN)) * np.uint64(0xBF58476D1CE4E5B9)
    return grid.view(np.uint8).reshape(count, page_bytes)


def fill_pattern(pool: KVPool, pages: npt.NDArray[np.int64], seed: int) -> None:
    """Write :func:`pattern_pages` into ``pages`` of ``pool`` (host or GPU)."""
    data = pattern_pages(seed, int(pages.size), pool.page_bytes)
    host = pool.host_view
    if host is not None:
        host[pages] = data
        return
    import torch

    tensor = pool.tensor_view
    assert tensor is not None
    index = torch.tensor(pages, device=tensor.device)  # a copy: pages may be read-only
    tensor.index_copy_(0, index, torch.from_numpy(data).to(tensor.device))
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def _read_pages(pool: KVPool, pages: npt.NDArray[np.int64]) -> npt.NDArray[np.uint8]:
    host = pool.host_view
    if host is not None:
        return host[pages]
    tensor = pool.tensor_view
    assert tensor is not None
    import torch

    index = torch.tensor(pages, device=tensor.device)  # a copy: pages may be read-only
    out: npt.NDArray[np.uint8] = tensor.index_select(0, index).cpu().numpy()
    return out


def _failed(exc: BaseException) -> Outcome:
    if isinstance(exc, RequestError):
        code, message = exc.to_wire()
        return Outcome(ok=False, code=code, message=message)
    return Outcome(ok=False, code="internal", message=f"{type(exc).__name__}: {exc}")


# -- the child ------------------------------------------------------------------------------


class _Worker:
    def __init__(self, pool: KVPool, kv: PrefillKV | DecodeKV, agent: NixlAgent) -> None:
        self.pool = pool
        self.kv = kv
        self.agent = agent
        self.rooms: dict[int, PrefillRoom] = {}
        self.release: dict[int, anyio.Event] = {}
        self.outcomes: dict[int, Outcome] = {}
        self.outcome_ready: dict[int, anyio.Event] = {}

    def _alloc(self, packed: bytes, count: int) -> PageAllocation:
        return self.pool.alloc_exact(unpack_pages(packed)) if packed else self.pool.alloc(count)

    async def handle(self, cmd: Command, tg: anyio.abc.TaskGroup) -> Outcome | None:
        if isinstance(cmd, Stats):
            return Outcome(ok=True, endpoint=getattr(self.kv, "endpoint", ""), info=self.stats())
        if isinstance(cmd, Connect):
            assert isinstance(self.kv, DecodeKV)
            await self.kv.connect(cmd.endpoint)
            return Outcome(ok=True)
        if isinstance(cmd, Prefill):
            assert isinstance(self.kv, PrefillKV)
            room = self.kv.open_room(cmd.room)  # registered before the parent learns the triple
            self.rooms[cmd.room] = room
            self.release[cmd.room] = anyio.Event()
            self.outcome_ready[cmd.room] = anyio.Event()
            if not cmd.hold:
                self.release[cmd.room].set()
            tg.start_soon(self._prefill, cmd, room)
            return Outcome(ok=True, endpoint=self.kv.endpoint)
        if isinstance(cmd, Release):
            self.release[cmd.room].set()
            return Outcome(ok=True)
        if isinstance(cmd, WaitRoom):
            await self.outcome_ready[cmd.room].wait()
            return self.outcomes[cmd.room]
        if isinstance(cmd, Receive):
            return await self._receive(cmd)
        return None

    async def _prefill(self, cmd: Prefill, room: PrefillRoom) -> None:
        outcome = Outcome(ok=False, code="internal")
        try:
            with room, self._alloc(cmd.pages, cmd.num_pages) as alloc:
                fill_pattern(self.pool, alloc.pages, cmd.seed)
                await self.release[cmd.room].wait()
                from actors.kv._checksum import page_checksums

                sums = page_checksums(self.pool, alloc.pages)
                if cmd.corrupt >= 0:
                    host = self.pool.host_view
                    assert host is not None
                    host[alloc.pages[cmd.corrupt], 0] ^= 0xFF
                result = await room.send(alloc, checksums=sums)
                outcome = Outcome(
                    ok=True,
                    nbytes=result.nbytes,
                    descriptors=result.descriptors,
                    seconds=result.seconds,
                )
        except Exception as exc:
            outcome = _failed(exc)
        finally:
            self.outcomes[cmd.room] = outcome
            self.outcome_ready[cmd.room].set()

    async def _receive(self, cmd: Receive) -> Outcome:
        assert isinstance(self.kv, DecodeKV)
        alloc = self._alloc(cmd.pages, cmd.num_pages)
        try:
            got = await self.kv.receive(
                cmd.bootstrap, alloc, timeout=cmd.timeout, verify=cmd.verify
            )
        except Exception as exc:
            return _failed(exc)  # the service owns (and frees) the pages now
        with got.pages:
            if cmd.check_bytes:
                want = pattern_pages(cmd.seed, len(alloc), self.pool.page_bytes)
                if not np.array_equal(_read_pages(self.pool, alloc.pages), want):
                    return Outcome(ok=False, code="kv.corrupted", message="bytes differ")
            return Outcome(ok=True, nbytes=len(alloc) * self.pool.page_bytes, seconds=got.seconds)

    def stats(self) -> dict[str, dict[str, Any]]:
        return {
            "pool": asdict(self.pool.statistics()),
            "agent": asdict(self.agent.statistics()),
            "kv": asdict(self.kv.statistics()),
        }


async def _child_main(args: argparse.Namespace) -> None:
    config = KVConfig(
        heartbeat_interval=args.heartbeat,
        peer_timeout=args.peer_timeout,
        poll_while_pending=args.poll_while_pending,
    )
    # The pool first: on a GPU it creates the CUDA context UCX's CUDA transports look for.
    pool = KVPool.allocate(args.pages, args.page_bytes, device=args.device)
    with NixlAgent(args.agent_name, prefix=args.role) as agent:
        kv: PrefillKV | DecodeKV
        if args.role == "prefill":
            kv = PrefillKV(
                agent, pool, endpoint=args.bootstrap, worker_id=args.worker_id, config=config
            )
        else:
            kv = DecodeKV(agent, pool, worker_id=args.worker_id, config=config)
        control = AsyncSocket.create(zmq.ROUTER)
        try:
            control.bind(args.control)
            async with kv, anyio.create_task_group() as tg:
                worker = _Worker(pool, kv, agent)
                await _serve(control, worker, tg)
                tg.cancel_scope.cancel()
        finally:
            control.close()
            pool.close()


async def _serve(control: AsyncSocket, worker: _Worker, tg: anyio.abc.TaskGroup) -> None:
    decoder = msgspec.msgpack.Decoder(_Envelope)
    encoder = msgspec.msgpack.Encoder()
    stop = anyio.Event()

    def reply(rid: bytes, request_id: int, outcome: Outcome) -> None:
        chan.send([rid, encoder.encode(_ReplyEnvelope(request_id, outcome))])

    async def run(rid: bytes, env: _Envelope) -> None:
        try:
            outcome = await worker.handle(env.body, tg)
        except Exception as exc:
            outcome = _failed(exc)
        if outcome is not None:
            reply(rid, env.id, outcome)

    def on_frames(frames: list[bytes]) -> None:
        rid, payload = frames
        env = decoder.decode(payload)
        if isinstance(env.body, Stop):
            reply(rid, env.id, Outcome(ok=True))
            stop.set()
        else:
            tg.start_soon(run, rid, env)

    chan = Channel(control, on_frames)
    tg.start_soon(chan.run)
    await stop.wait()


# -- the parent -------------------------------------------------------------------------------


class PeerProcess:
    """A child KV worker and a client for its control socket. Start with :meth:`start`."""

    def __init__(self, process: anyio.abc.Process, control: AsyncSocket) -> None:
        self.process = process
        self._control = Channel(control, self._on_frames)
        self._ids = itertools.count(1)
        self._killed = False
        self._waiters: dict[int, tuple[anyio.Event, list[Outcome]]] = {}
        self._decoder = msgspec.msgpack.Decoder(_ReplyEnvelope)
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
    ) -> AsyncIterator[PeerProcess]:
        """Run a peer; on exit stop it (gracefully, else SIGKILL) and reap it."""
        cmd = [sys.executable, "-m", "actors.kv._peer", "--role", role, "--control", control]
        cmd += ["--pages", str(num_pages), "--page-bytes", str(page_bytes), "--device", device]
        cmd += ["--bootstrap", bootstrap, "--heartbeat", str(heartbeat)]
        cmd += ["--peer-timeout", str(peer_timeout)]
        if worker_id:
            cmd += ["--worker-id", worker_id]
        if agent_name:
            cmd += ["--agent-name", agent_name]
        if poll_while_pending:
            cmd += ["--poll-while-pending"]
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
            self._control.send([self._encoder.encode(_Envelope(request_id, cmd))])
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


def _main() -> None:
    parser = argparse.ArgumentParser(prog="python -m actors.kv._peer")
    parser.add_argument("--role", choices=["prefill", "decode"], required=True)
    parser.add_argument("--control", required=True)
    parser.add_argument("--pages", type=int, default=256)
    parser.add_argument("--page-bytes", type=int, default=4096)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bootstrap", default="tcp://127.0.0.1:0")
    parser.add_argument("--worker-id", default=None)
    parser.add_argument("--agent-name", default=None)
    parser.add_argument("--heartbeat", type=float, default=0.1)
    parser.add_argument("--peer-timeout", type=float, default=1.0)
    parser.add_argument("--poll-while-pending", action="store_true")
    args = parser.parse_args()
    anyio.run(_child_main, args)


if __name__ == "__main__":
    _main()
