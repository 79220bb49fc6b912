"""A prefill worker's KV bridge frees the engine's owed KV however its stream ends: read to the
end, closed right after its output (the request stream that read it went away), or cancelled
while the room waits for decode."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from typing import Literal

import anyio
import pytest

from actors.serving.engines import FAKE_BOOTSTRAP_HOST, MockEngine
from actors.serving.worker._faults import InjectedFaults
from actors.serving.worker._kvbridge import KVBridge, MockTransfer
from protocols.engine import BootstrapInfo
from tests.engines._mock_helpers import config, request

PROMPT = list(range(100, 140))  # two full pages of 16 and a partial one


@pytest.fixture
def short_tempdir(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The bridge binds its bootstrap socket in the temporary directory (a worker process's own),
    and socket paths are limited to ~107 bytes."""
    path = tempfile.mkdtemp(prefix="kvb-", dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", path)
    try:
        yield
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("how", ["close", "cancel"])
async def test_a_prefill_stream_abandoned_after_its_output_frees_the_owed_kv(
    how: Literal["close", "cancel"], short_tempdir: None
) -> None:
    async with MockEngine(config(role="prefill")) as engine:
        transfer = MockTransfer(engine, InjectedFaults())
        async with KVBridge(transfer, "prefill", "prefill-0") as bridge:
            for i in range(3):
                # A room no decode worker ever asks for: decode died before it could.
                boot = BootstrapInfo(host="127.0.0.1", port=7100, room=1000 + i)
                assert boot.host != FAKE_BOOTSTRAP_HOST
                outputs = bridge.prefill(request(f"r{i}", PROMPT, bootstrap=boot))
                if how == "close":
                    first = await outputs.__anext__()
                    assert first.finish_reason is not None and first.disaggregated_params
                    assert engine.statistics().used_blocks > 0  # owed to decode
                    await outputs.aclose()
                else:
                    with anyio.move_on_after(0.2):
                        async for _ in outputs:
                            pass
                    await outputs.aclose()
                # Freed at once, not after the engine's transfer timeout (minutes).
                stats = engine.statistics()
                assert (stats.in_flight, stats.used_blocks) == (0, 0)
                assert engine.is_quiescent()
