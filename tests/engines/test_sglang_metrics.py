"""The SGLang metrics reader.

See tests/engines/_sglang_fakes.py for how the fakes follow the record.
"""

from __future__ import annotations

import os
import pickle
import sys
import types
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import zmq

from actors._zmq import context as zmq_context
from actors.serving.engines._sglang._metrics import (
    KV_METRICS_FIELDS,
    SGLangMetricsReader,
    decode_kv_metrics,
)
from protocols.metrics import LoadMetrics

# ------------------------------------------------------------------------------------------
# (c) Metrics
# ------------------------------------------------------------------------------------------


SGLANG_MODULE = "sglang.srt.managers.scheduler_components.kv_events_publisher"


class KvMetrics(msgspec.Struct, tag=True, kw_only=True, array_like=True):
    """SGLang 0.5.17's ``KvMetrics`` (its scheduler pickles it by reference to its module)."""

    request_active_slots: int = 0
    request_total_slots: int = 0
    kv_active_blocks: int = 0
    kv_total_blocks: int = 0
    num_requests_waiting: int = 0
    gpu_cache_usage_perc: float = 0.0
    gpu_prefix_cache_hit_rate: float = 0.0
    data_parallel_rank: int | None = 0


def sglang_pickle(module: str = SGLANG_MODULE, **values: Any) -> bytes:
    """The bytes SGLang's scheduler sends: its struct pickled as ``rebuild(KvMetrics, fields)``
    (the class lent to ``module`` for the dump only: no SGLang here)."""
    parts = module.split(".")
    packages = [".".join(parts[: i + 1]) for i in range(len(parts))]
    sys.modules.update({name: types.ModuleType(name) for name in packages})
    sys.modules[module].KvMetrics = KvMetrics  # type: ignore[attr-defined]
    home = KvMetrics.__module__
    KvMetrics.__module__ = module
    try:
        return pickle.dumps(KvMetrics(**values), protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        KvMetrics.__module__ = home
        for name in packages:
            del sys.modules[name]


def test_metrics_reader_accepts_only_ipc() -> None:
    for endpoint in ("tcp://127.0.0.1:5000", "tcp://*:5000", "inproc://m"):
        with pytest.raises(ValueError, match="ipc://"):
            SGLangMetricsReader(endpoint)


def test_decode_kv_metrics_formats() -> None:
    values = dict(zip(KV_METRICS_FIELDS, (3, 64, 100, 4096, 2, 0.25, 0.5, 1), strict=True))
    want = LoadMetrics(**values)
    data = sglang_pickle(**values)
    assert b"msgspec._utils" in data and SGLANG_MODULE.encode() in data  # the real shape
    assert decode_kv_metrics(data) == want
    assert "sglang" not in sys.modules  # read as data: SGLang was never imported
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        decode_kv_metrics(sglang_pickle("elsewhere", **values))  # not SGLang's: refused
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        decode_kv_metrics(pickle.dumps(os.getcwd))  # any other global: refused
    tagged = msgspec.msgpack.encode(["KvMetrics", *values.values()])
    assert decode_kv_metrics(tagged) == want
    rank_none = sglang_pickle(**{**values, "data_parallel_rank": None})
    assert decode_kv_metrics(rank_none).data_parallel_rank == 0
    # SGLang counts KV in tokens; with pages of 16 the reader reports pages.
    paged = decode_kv_metrics(data, page_size=16)
    assert (paged.kv_active_blocks, paged.kv_total_blocks) == (100 // 16, 4096 // 16)


async def test_metrics_reader_converts_pushed_metrics(anyio_backend: str, tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/metrics"
    values = dict(zip(KV_METRICS_FIELDS, (1, 8, 10, 100, 0, 0.1, 0.0, 0), strict=True))
    async with SGLangMetricsReader(endpoint) as reader:
        assert reader.receive_nowait() is None
        push = zmq_context().socket(zmq.PUSH)
        try:
            push.setsockopt(zmq.LINGER, 0)
            push.connect(endpoint)  # as SGLang's schedulers do
            # Anything else on the socket is skipped and counted, never fatal.
            push.send(b"not metrics")
            push.send(pickle.dumps(os.getcwd))
            push.send(sglang_pickle(**values))
            with anyio.fail_after(5):
                got = await reader.receive()
        finally:
            push.close()
    assert got == LoadMetrics(**values)
    assert reader.undecodable == 2
    reader.close()
    with pytest.raises(RuntimeError, match="not open"):
        reader.receive_nowait()
