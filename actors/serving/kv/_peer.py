"""A KV worker in its own OS process, driven over ZMQ: the other end for tests and benchmarks.

``python -m actors.serving.kv._peer --role prefill|decode --control ipc://...`` runs a
:class:`~actors.serving.kv.PrefillKV` or :class:`~actors.serving.kv.DecodeKV` over its own NIXL
agent and pool and obeys typed commands (msgspec, no pickle) on a control socket it binds.
:class:`PeerProcess` starts one and talks to it. Page contents come from :func:`fill_pattern`: a
deterministic function of ``(seed, position in the request)``, so either side can check bytes.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

import anyio
import anyio.abc
import msgspec
import numpy as np
import zmq

from actors.lowlevel import AsyncSocket
from actors.serving.kv._bootstrap import KVConfig, unpack_pages
from actors.serving.kv._channel import Channel
from actors.serving.kv._decode import DecodeKV
from actors.serving.kv._nixl import NixlAgent
from actors.serving.kv._peer_protocol import (
    Command,
    Connect,
    Envelope,
    Outcome,
    Prefill,
    Receive,
    Release,
    ReplyEnvelope,
    Stats,
    Stop,
    WaitRoom,
    failed,
    fill_pattern,
    pattern_pages,
    read_pages,
)
from actors.serving.kv._peerproc import PeerProcess, bootstrap_for
from actors.serving.kv._pool import KVPool, PageAllocation
from actors.serving.kv._prefill import PrefillKV
from actors.serving.kv._room import PrefillRoom

__all__ = [
    "Connect",
    "Outcome",
    "PeerProcess",
    "Prefill",
    "Receive",
    "Release",
    "Stats",
    "WaitRoom",
    "bootstrap_for",
    "fill_pattern",
    "pattern_pages",
    "read_pages",
]

_GOLDEN = 0x9E3779B97F4A7C15


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
                from actors.serving.kv._checksum import page_checksums

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
            outcome = failed(exc)
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
            return failed(exc)  # the service owns (and frees) the pages now
        with got.pages:
            if cmd.check_bytes:
                want = pattern_pages(cmd.seed, len(alloc), self.pool.page_bytes)
                if not np.array_equal(read_pages(self.pool, alloc.pages), want):
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
        split_min_bytes=args.split_min_bytes,
    )
    # The pool first: on a GPU it creates the CUDA context UCX's CUDA transports look for.
    pool = KVPool.allocate(args.pages, args.page_bytes, device=args.device)
    with NixlAgent(args.agent_name, prefix=args.role, num_threads=args.threads) as agent:
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
    decoder = msgspec.msgpack.Decoder(Envelope)
    encoder = msgspec.msgpack.Encoder()
    stop = anyio.Event()

    def reply(rid: bytes, request_id: int, outcome: Outcome) -> None:
        chan.send([rid, encoder.encode(ReplyEnvelope(request_id, outcome))])

    async def run(rid: bytes, env: Envelope) -> None:
        try:
            outcome = await worker.handle(env.body, tg)
        except Exception as exc:
            outcome = failed(exc)
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


def _main() -> None:
    parser = argparse.ArgumentParser(prog="python -m actors.serving.kv._peer")
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
    parser.add_argument("--threads", type=int, default=0, help="the agent's posting threads")
    parser.add_argument("--split-min-bytes", type=int, default=KVConfig().split_min_bytes)
    args = parser.parse_args()
    anyio.run(_child_main, args)


if __name__ == "__main__":
    _main()
