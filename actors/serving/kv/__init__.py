"""KV cache transfer between prefill and decode workers over NIXL (UCX), SGLang-style.

Pieces, from the bottom up:

- :class:`NixlAgent`: one NIXL agent (UCX backend, progress thread off) with leak accounting.
- :class:`KVPool`: a worker's KV pages in one region (host or GPU memory), registered with NIXL
  once; allocates pages (contiguous runs when it can) and adopts an engine's own buffer.
- :class:`PrefillKV` / :class:`PrefillRoom`: the prefill worker's bootstrap endpoint (ZMQ
  ROUTER) and its rooms: register a room, publish its bootstrap triple, ``send`` the computed
  pages (one coalesced, batched NIXL WRITE plus one notification), ``wait_transfers_done``;
  :func:`post_together` posts several rooms to one decode peer as one WRITE (a drain's).
- :class:`DecodeKV`: the decode worker's side: ``connect`` to prefill endpoints ahead of time,
  ``receive`` a room into freshly allocated pages, verified by per-page checksums.

Failures are :mod:`protocols.errors` types: :class:`~protocols.errors.KVTransferError`
(migratable) and :class:`~protocols.errors.KVCorrupted`. Wire messages: :mod:`protocols.kv`.

Prefill worker (one service per worker, for its lifetime)::

    pool = KVPool.from_buffer(engine_kv_buffer, page_bytes)   # or KVPool.allocate(...)
    config = KVConfig()                                       # timeouts, posting threads
    threads = config.agent_threads(pool.mem_type)             # host memory: split big WRITEs
    agent = NixlAgent(prefix="prefill-0", num_threads=threads)  # after CUDA is initialised
    async with PrefillKV(agent, pool, endpoint="tcp://127.0.0.1:0", config=config) as kv:
        ...
        with kv.open_room(room) as r:          # register first,
            publish(r.bootstrap)               # then hand out (host, port, room)
            pages = compute_kv(request)        # engine's pages in ``pool``
            await r.send(pages)                # WRITE + notification; terminal on return
        free(pages)
        ...
        await kv.wait_transfers_done(timeout)  # shutdown drain, before freeing memory

Decode worker::

    async with DecodeKV(agent, pool, worker_id="decode-0") as kv:
        await kv.connect(prefill_endpoint)     # when the peers first meet (pre-warm)
        ...
        pages = pool.alloc(n)
        got = await kv.receive(request.bootstrap_info, pages, expected_checksums=...)
        # on error or cancellation ``pages`` belong to the service, which frees them safely
"""

from actors.serving.kv._bootstrap import (
    KVConfig,
    bootstrap_endpoint,
    bootstrap_info,
    new_room,
)
from actors.serving.kv._checksum import checksums_of, page_checksums
from actors.serving.kv._decode import DecodeKV, DecodeStatistics, ExpectedChecksums, ReceivedKV
from actors.serving.kv._group import post_together
from actors.serving.kv._nixl import AgentStatistics, NixlAgent, NixlError, load_nixl
from actors.serving.kv._pool import KVPool, KVPoolExhausted, PageAllocation, PoolStatistics
from actors.serving.kv._prefill import PrefillKV, PrefillStatistics
from actors.serving.kv._room import DecodeCancelled, PrefillRoom, RoomState, TransferResult
from actors.serving.kv._transfer import Descriptors, TransferAborted, coalesce

__all__ = [
    "AgentStatistics",
    "DecodeCancelled",
    "DecodeKV",
    "DecodeStatistics",
    "Descriptors",
    "ExpectedChecksums",
    "KVConfig",
    "KVPool",
    "KVPoolExhausted",
    "NixlAgent",
    "NixlError",
    "PageAllocation",
    "PoolStatistics",
    "PrefillKV",
    "PrefillRoom",
    "PrefillStatistics",
    "ReceivedKV",
    "RoomState",
    "TransferAborted",
    "TransferResult",
    "bootstrap_endpoint",
    "bootstrap_info",
    "checksums_of",
    "coalesce",
    "load_nixl",
    "new_room",
    "page_checksums",
    "post_together",
]
