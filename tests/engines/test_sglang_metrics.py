"""The SGLang metrics reader.

See tests/engines/_sglang_fakes.py for how the fakes follow the record.
"""

from __future__ import annotations

import os
import pickle
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


class KvMetricsLike:
    """Plays SGLang's KvMetrics (pickled by reference to this test module)."""

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)


def test_metrics_reader_accepts_only_ipc() -> None:
    for endpoint in ("tcp://127.0.0.1:5000", "tcp://*:5000", "inproc://m"):
        with pytest.raises(ValueError, match="ipc://"):
            SGLangMetricsReader(endpoint)


def test_decode_kv_metrics_formats() -> None:
    values = dict(zip(KV_METRICS_FIELDS, (3, 64, 100, 4096, 2, 0.25, 0.5, 1), strict=True))
    want = LoadMetrics(**values)
    data = pickle.dumps(KvMetricsLike(**values), protocol=pickle.HIGHEST_PROTOCOL)
    assert decode_kv_metrics(data, (__name__,)) == want
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        decode_kv_metrics(data)  # this module is not SGLang: refused by default
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        decode_kv_metrics(pickle.dumps(os.getcwd), (__name__,))  # any other global: refused
    tagged = msgspec.msgpack.encode(["KvMetrics", *values.values()])
    assert decode_kv_metrics(tagged) == want
    rank_none = pickle.dumps(KvMetricsLike(**{**values, "data_parallel_rank": None}))
    assert decode_kv_metrics(rank_none, (__name__,)).data_parallel_rank == 0


async def test_metrics_reader_converts_pushed_metrics(anyio_backend: str, tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/metrics"
    values = dict(zip(KV_METRICS_FIELDS, (1, 8, 10, 100, 0, 0.1, 0.0, 0), strict=True))
    async with SGLangMetricsReader(endpoint, allowed_modules=(__name__,)) as reader:
        assert reader.receive_nowait() is None
        push = zmq_context().socket(zmq.PUSH)
        try:
            push.setsockopt(zmq.LINGER, 0)
            push.connect(endpoint)  # as SGLang's schedulers do
            push.send(pickle.dumps(KvMetricsLike(**values), protocol=pickle.HIGHEST_PROTOCOL))
            with anyio.fail_after(5):
                got = await reader.receive()
        finally:
            push.close()
    assert got == LoadMetrics(**values)
    reader.close()
    with pytest.raises(RuntimeError, match="not open"):
        reader.receive_nowait()
