"""Read SGLang's scheduler load metrics (``KvMetrics``) from its metrics socket.

Every SGLang scheduler (one per data-parallel rank) PUSHes a ``KvMetrics`` after each step to
``engine.port_args.metrics_ipc_name``; nobody in SGLang binds that address, the consumer does (as
Dynamo's publisher does), with a ZMQ PULL socket. With SGLang's default IPC codec
(``SGLANG_USE_PICKLE_IPC``, on by default in 0.5.x) the message is a pickle; otherwise it is
SGLang's msgpack encoding of the struct (a tagged array).

This is the only place in actorserve that unpickles anything, and it does so only from an
``ipc://`` path the worker owns (a filesystem socket reachable only on this host, with the
worker's file permissions), and as data: SGLang pickles its ``KvMetrics`` struct as msgspec's
``rebuild(KvMetrics, fields)``, and the unpickler answers those two names with stand-ins that
return the fields. It imports nothing (not SGLang, whose import would stall the reader's event
loop for seconds) and refuses every other global. Each message becomes a :class:`LoadMetrics` at
once, so nothing SGLang-shaped leaves this module.
"""

from __future__ import annotations

import io
import logging
import pickle
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import msgspec
import zmq

from actors.lowlevel import AsyncSocket
from protocols.metrics import LoadMetrics

__all__ = ["KV_METRICS_FIELDS", "SGLangMetricsReader", "decode_kv_metrics"]

_log = logging.getLogger(__name__)

# SGLang's KvMetrics field order (also its msgpack array order); checked against the record.
KV_METRICS_FIELDS: tuple[str, ...] = (
    "request_active_slots",
    "request_total_slots",
    "kv_active_blocks",
    "kv_total_blocks",
    "num_requests_waiting",
    "gpu_cache_usage_perc",
    "gpu_prefix_cache_hit_rate",
    "data_parallel_rank",
)
_FLOATS = frozenset({"gpu_cache_usage_perc", "gpu_prefix_cache_hit_rate"})
_PICKLE_PROTO = 0x80  # every pickle of protocol >= 2 starts with PROTO


class _KvMetricsName:
    """Stands in for SGLang's ``KvMetrics`` class in a pickle (never imported)."""


def _rebuild(cls: Any, fields: Any) -> dict[str, Any]:
    """msgspec's ``rebuild(cls, fields)``, kept as data: the struct's fields."""
    if cls is not _KvMetricsName or not isinstance(fields, dict):
        raise pickle.UnpicklingError("the metrics socket sends only SGLang's KvMetrics")
    return fields


class _DataUnpickler(pickle.Unpickler):
    """Resolves msgspec's ``rebuild`` and a ``KvMetrics`` from an allowed module prefix to
    stand-ins; any other global is refused."""

    def __init__(self, data: bytes, allowed_modules: Sequence[str]) -> None:
        super().__init__(io.BytesIO(data))
        self._allowed = tuple(allowed_modules)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("msgspec._utils", "rebuild"):
            return _rebuild
        allowed = any(module == p.rstrip(".") or module.startswith(p) for p in self._allowed)
        if allowed and name == "KvMetrics":
            return _KvMetricsName
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from the metrics socket")


def decode_kv_metrics(
    data: bytes, allowed_modules: Sequence[str] = ("sglang.",), *, page_size: int = 1
) -> LoadMetrics:
    """Convert one message from SGLang's metrics socket into :class:`LoadMetrics`.

    SGLang counts its "blocks" in tokens (``kv_total_blocks`` is ``max_total_num_tokens``);
    ``page_size`` turns them into pages, the blocks the router and the gauges count.
    """
    obj: Any
    if data[:1] == bytes([_PICKLE_PROTO]):
        obj = _DataUnpickler(data, allowed_modules).load()
    else:
        obj = msgspec.msgpack.decode(data)
    metrics = _convert(obj)
    if page_size == 1:
        return metrics
    return msgspec.structs.replace(
        metrics,
        kv_active_blocks=metrics.kv_active_blocks // page_size,
        kv_total_blocks=metrics.kv_total_blocks // page_size,
    )


def _convert(obj: Any) -> LoadMetrics:
    values: dict[str, Any]
    if isinstance(obj, dict):
        values = {k: obj[k] for k in KV_METRICS_FIELDS if k in obj}
    elif isinstance(obj, list | tuple):
        # msgpack of a tagged array-like struct: [tag, field, field, ...]
        items = list(obj[1:]) if obj and isinstance(obj[0], str) else list(obj)
        values = dict(zip(KV_METRICS_FIELDS, items, strict=False))
    else:
        raise msgspec.DecodeError(f"not SGLang's KvMetrics: {type(obj).__name__}")
    out: dict[str, Any] = {}
    for key, value in values.items():
        if value is None:
            continue  # e.g. data_parallel_rank None on a single-rank engine: keep the default
        out[key] = float(value) if key in _FLOATS else int(value)
    return LoadMetrics(**out)


class SGLangMetricsReader:
    """A PULL socket bound at SGLang's metrics ``ipc://`` path, yielding :class:`LoadMetrics`.

    Use as an async context manager (or ``open``/``close``); ``receive`` waits for the next
    message. Works on asyncio and trio (the socket is waited on through anyio).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        allowed_modules: Sequence[str] = ("sglang.",),
        page_size: int = 1,
    ) -> None:
        if not endpoint.startswith("ipc://"):
            # Unpickling is only acceptable from a host-local socket the worker owns.
            raise ValueError(
                f"SGLang metrics are read only from an ipc:// endpoint, not {endpoint}"
            )
        self.endpoint = endpoint
        self._allowed = tuple(allowed_modules)
        self._page_size = page_size
        self._sock: AsyncSocket | None = None
        self.undecodable = 0  # messages skipped

    def open(self) -> None:
        """Bind the PULL socket (idempotent)."""
        if self._sock is None:
            sock = AsyncSocket.create(zmq.PULL)
            try:
                sock.bind(self.endpoint)
            except BaseException:
                sock.close()
                raise
            self._sock = sock

    def close(self) -> None:
        """Close the socket (idempotent)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def drop(self) -> None:
        """Close the socket under a task waiting in ``receive`` (it raises
        ``ClosedResourceError``), for fault injection."""
        if self._sock is not None:
            self._sock.abort()
            self._sock = None

    async def __aenter__(self) -> SGLangMetricsReader:
        self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _socket(self) -> AsyncSocket:
        if self._sock is None:
            raise RuntimeError("the metrics reader is not open")
        return self._sock

    def receive_nowait(self) -> LoadMetrics | None:
        """The next queued message, converted, or ``None`` when none is queued."""
        while (frames := self._socket().recv_multipart_nowait()) is not None:
            if (metrics := self._decode(frames[-1])) is not None:
                return metrics
        return None

    async def receive(self) -> LoadMetrics:
        """Wait for the next message and convert it."""
        while True:
            frames = await self._socket().recv_multipart()
            if (metrics := self._decode(frames[-1])) is not None:
                return metrics

    def _decode(self, data: bytes) -> LoadMetrics | None:
        # A message that is not SGLang's metrics is skipped and counted, never fatal: a reader
        # that crashed on one would restart its worker over and over.
        try:
            return decode_kv_metrics(data, self._allowed, page_size=self._page_size)
        except (pickle.UnpicklingError, msgspec.DecodeError, ValueError, TypeError, EOFError):
            if not self.undecodable:
                _log.warning("skipping undecodable messages on %s", self.endpoint)
            self.undecodable += 1
            return None
