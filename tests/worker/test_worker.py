"""The worker: engine actor in a child process, publisher and health checker, one_for_all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import zmq

from actors import Actor, ActorCrashed, current_registry
from actors._zmq import context as zmq_context
from actors.process import ProcessOptions
from actors.serving import RoutingTable
from actors.serving.engines import MockEngineConfig, TimingModel
from actors.serving.worker import (
    BACKENDS,
    HealthOptions,
    UnknownBackend,
    engine_backend,
    engine_name,
    worker_spec,
)
from actors.serving.worker._faults import InjectedFaults
from actors.serving.worker._publisher import Publisher
from actors.telemetry import REGISTRY
from protocols import PreprocessedRequest, StopConditions, control
from protocols.engine import Capacity, MemoryTag, PauseMode
from protocols.errors import EngineFailure
from supervisors import ChildSpec, SupervisorFlags, SupervisorRef, open_supervisor

CONFIG = msgspec.msgpack.encode(
    MockEngineConfig(
        timing=TimingModel(speedup=50), num_blocks=256, block_size=16, kv_bytes_per_block=256
    )
)


def _spec(table: RoutingTable, **kw: Any) -> Any:
    return worker_spec(
        "w0",
        "mock",
        CONFIG,
        directory=table,
        sink=table,
        process=kw.pop("process", ProcessOptions(heartbeat_interval=0.05, heartbeat_timeout=2.0)),
        health=kw.pop(
            "health", HealthOptions(idle_after=0.2, timeout=0.5, failures=2, interval=0.1)
        ),
        **kw,
    )


def _engine() -> Any:
    ref = current_registry().whereis(engine_name("w0"))
    assert ref is not None
    return ref


async def _generate(tokens: list[int], max_tokens: int = 8) -> list[int]:
    request = PreprocessedRequest(
        rid=os.urandom(4).hex(),
        token_ids=tokens,
        stop_conditions=StopConditions(max_tokens=max_tokens),
    )
    out: list[int] = []
    async with _engine().stream(request) as outputs:
        async for output in outputs:
            out.extend(output.token_ids)
    return out


async def test_engine_actor_serves_the_contract_across_the_process_boundary() -> None:
    table = RoutingTable({"w0": "aggregated"})
    async with open_supervisor([_spec(table)]):
        await table.wait_routable()
        engine = _engine()
        first = await _generate(list(range(40)))
        assert first == await _generate(list(range(40)))  # deterministic
        assert len(first) == 8
        capacity = await engine.ask(control.GetCapacity())
        assert capacity.total_kv_blocks == 256
        await engine.ask(control.Pause(PauseMode.IN_PLACE))
        await engine.ask(control.ContinueGeneration())
        await engine.ask(control.ReleaseMemory((MemoryTag.WEIGHTS,)))
        stats = await engine.ask(control.GetStats())
        assert MemoryTag.WEIGHTS in stats.released
        # The engine contract's statistics, read with no guessing: none is "unknown" (-1).
        assert stats.kv_used_blocks == 0 and stats.engine_in_flight == 0
        assert stats.prefill_tokens > 0 and stats.kv_received_tokens == 0
        await engine.ask(control.ResumeMemory((MemoryTag.WEIGHTS,)))
        assert await engine.ask(control.IsQuiescent()) is True
        assert await engine.ask(control.FlushCache()) is True


async def test_publisher_feeds_kv_events_and_load_and_reconnects_after_engine_restart() -> None:
    table = RoutingTable({"w0": "aggregated"})
    prompt = list(range(64))
    async with open_supervisor([_spec(table)], SupervisorFlags(intensity=5)) as root:
        await table.wait_routable()
        await _generate(prompt)
        with anyio.fail_after(10):
            while table.overlap("w0", prompt) < 3:
                await anyio.sleep(0.02)
        pid = (await _engine().ask(control.GetStats())).pid
        os.kill(pid, signal.SIGKILL)
        # one_for_all: engine, publisher and checker restart together; the new publisher
        # subscribes to the new engine's endpoints.
        with anyio.fail_after(15):
            while "w0" not in table.workers or (await _safe_pid()) in (None, pid):
                await anyio.sleep(0.05)
        await table.wait_routable()
        assert table.overlap("w0", prompt) == 0  # a fresh engine holds nothing
        await _generate(prompt)
        with anyio.fail_after(10):
            while table.overlap("w0", prompt) < 3:
                await anyio.sleep(0.02)
        worker = SupervisorRef(await root.child("w0"))
        assert (await worker.statistics()).restarts >= 1


async def _safe_pid() -> int | None:
    try:
        return int((await _engine().ask(control.GetStats())).pid)
    except ActorCrashed:
        return None
    except Exception:
        return None


@pytest.mark.parametrize("fault", ["sigstop", "sigkill"])
async def test_health_checker_fails_a_hung_or_dead_engine(fault: str) -> None:
    table = RoutingTable({"w0": "aggregated"})
    # Heartbeats are slow here, so it is the health checker that must notice.
    process = ProcessOptions(heartbeat_interval=0.05, heartbeat_timeout=60.0)
    async with open_supervisor(
        [_spec(table, process=process)], SupervisorFlags(intensity=5)
    ) as root:
        await table.wait_routable()
        pid = (await _engine().ask(control.GetStats())).pid
        worker = SupervisorRef(await root.child("w0"))
        os.kill(pid, signal.SIGSTOP if fault == "sigstop" else signal.SIGKILL)
        try:
            with anyio.fail_after(20):
                while (await worker.statistics()).restarts < 1:
                    await anyio.sleep(0.05)
        finally:
            if fault == "sigstop":
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        await table.wait_routable()
        assert await _generate([1, 2, 3], 2)


async def test_canary_judges_the_whole_stream() -> None:
    table = RoutingTable({"w0": "aggregated"})
    async with open_supervisor(
        [_spec(table, health=HealthOptions(idle_after=60, interval=60))]
    ) as root:
        await table.wait_routable()
        worker = SupervisorRef(await root.child("w0"))
        health = await worker.child("health")
        assert await health.ask("canary") is True
        assert await health.ask("failures") == 0


def test_one_table_knows_the_backends_and_names_them_for_an_unknown_one() -> None:
    assert set(BACKENDS) == {"mock", "hf", "sglang"}
    assert engine_backend("sglang").kv_transfer is None  # it moves KV itself
    with pytest.raises(UnknownBackend, match=r"'vllm' \(known: mock, hf, sglang\)"):
        engine_backend("vllm")


def test_the_backend_table_imports_no_backend_until_one_is_used() -> None:
    heavy = ("torch", "transformers", "sglang")
    code = (
        "import sys, actors.serving, actors.serving.cli\n"
        f"assert not [m for m in {heavy!r} if m in sys.modules]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_injected_faults_are_armed_only_while_one_is_left() -> None:
    faults = InjectedFaults()
    assert not faults.armed and not faults.take("generate")  # the flag is all a path reads
    faults.add("generate", 2)
    assert faults.armed and faults.take("generate") and faults.armed
    with pytest.raises(EngineFailure, match="injected fault in generate"):
        faults.check("generate")
    assert not faults.armed
    faults.check("generate")  # none left: no failure


class _PushingEngine(Actor):
    """Stands in for an SGLang engine actor: its capacity says its schedulers PUSH their load
    metrics (SGLang's encoding, KV "blocks" counted in tokens) to an ipc path nobody binds."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    async def receive(self, message: Any) -> Any:
        if isinstance(message, control.GetCapacity):
            return Capacity(
                total_kv_blocks=4096,
                block_size=16,
                max_running_requests=48,
                max_batch_tokens=8192,
                context_length=4096,
                metrics_endpoint=self.endpoint,
                metrics_pushed=True,
            )
        if isinstance(message, control.GetStats):
            return control.EngineStats(
                running=0, finished=0, last_output=0.0, released=(), quiescent=True
            )
        return await super().receive(message)


async def test_publisher_binds_for_metrics_an_engine_pushes(tmp_path: Path) -> None:
    table = RoutingTable({"w0": "aggregated"})
    endpoint = f"ipc://{tmp_path}/metrics"
    name = engine_name("w0")
    children = [
        ChildSpec("engine", lambda: _PushingEngine(endpoint), name=name),
        ChildSpec("publisher", lambda: Publisher("w0", name, table)),
    ]
    async with open_supervisor(children):
        table.register("w0", _engine(), await _engine().ask(control.GetCapacity()))
        push = zmq_context().socket(zmq.PUSH)
        try:
            push.setsockopt(zmq.LINGER, 0)
            push.connect(endpoint)  # as SGLang's schedulers do; the publisher binds
            # SGLang's msgpack of its KvMetrics struct: 3 running, 65536 tokens of KV.
            message = msgspec.msgpack.encode(["KvMetrics", 3, 48, 1600, 65536, 2, 0.25, 0.5, 0])
            with anyio.fail_after(10):
                while table.workers["w0"].reported_active != 3:
                    push.send(message)
                    await anyio.sleep(0.02)
        finally:
            push.close()
        entry = table.workers["w0"]
        assert (entry.waiting, entry.cache_usage) == (2, 0.25)
        # The gauges count pages, as the router does: SGLang's 65536 tokens are 4096 blocks.
        total = REGISTRY.get_sample_value(
            "actorserve_worker_total_blocks", {"worker": "w0", "dp_rank": "0"}
        )
        assert total == 4096
