"""Carrying faults out against a running serving tree (in this process, engines in children)."""

from __future__ import annotations

import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import anyio
import attrs
import httpx

from actors import ActorError, ActorRef, current_registry
from actors.serving import Serving
from actors.serving.worker import engine_name
from protocols import control
from scenarios._faults_model import (
    Burst,
    CancelRequest,
    CrashEngine,
    CrashLoop,
    DropPublisher,
    FailCanaries,
    FailGenerate,
    FailKvTransfer,
    Fault,
    HangEngine,
    KillEngine,
    SlowEngine,
    StallEngine,
    _WorkerFault,
)
from scenarios._metrics import COUNTERS, scrape
from scenarios._model import Workload
from scenarios._subprocess import RootProcess
from scenarios._workload import Clock, RequestRecord, request_body, send, send_and_hang_up
from supervisors import SupervisorRef

__all__ = ["FaultRecord", "Injector", "Target", "inject", "register_injector"]


@attrs.define(kw_only=True)
class FaultRecord:
    """What became of one declared fault."""

    kind: str
    description: str
    target: str
    at: float  # when it was due (seconds after the faulted load started)
    injected_at: float | None = None
    ended_at: float | None = None
    detail: str = ""
    error: str | None = None  # why it did not happen as declared

    @property
    def injected(self) -> bool:
        return self.injected_at is not None and self.error is None


@attrs.define(kw_only=True)
class Target:
    """The running tree, as faults see it."""

    root: SupervisorRef | None  # None when the root runs in its own process
    serving: Serving
    client: httpx.AsyncClient
    clock: Clock
    workload: Workload
    fail_start_file: Path | None = None  # "{worker}" in it stands for the worker's id
    root_process: RootProcess | None = None
    extra: list[RequestRecord] = attrs.field(factory=list)  # requests faults sent

    @property
    def model(self) -> str:
        return self.serving.config.model

    @property
    def port(self) -> int:
        """The frontend's port (from the client's base URL: the root may run elsewhere)."""
        return self.client.base_url.port or 80

    def engine(self, worker: str) -> ActorRef[Any]:
        ref = current_registry().whereis(engine_name(worker))
        if ref is None:
            raise LookupError(f"no engine for worker {worker!r}")
        return ref

    async def stats(self, worker: str) -> control.EngineStats | None:
        """The engine's stats, or ``None`` while it is not answering (dead, restarting)."""
        try:
            stats = await self.engine(worker).ask(control.GetStats(), timeout=2.0)
        except (ActorError, LookupError, TimeoutError):
            return None
        return cast(control.EngineStats, stats)

    async def worker_supervisor(self, worker: str) -> SupervisorRef:
        if self.root is None:
            raise LookupError("the root runs in another process")
        pool = "prefill-pool" if worker.startswith("prefill") else "decode-pool"
        model = SupervisorRef(await self.root.child(f"model:{self.model}"))
        pool_ref = SupervisorRef(await model.child(pool))
        return SupervisorRef(await pool_ref.child(worker))

    async def busy_worker(self, fault: _WorkerFault) -> tuple[str, str | None]:
        """The worker ``fault`` aims at, once it streams ``when_busy`` requests (a prefill
        worker: runs them), or the wait ran out: then also why."""
        if fault.worker.startswith("busiest"):
            _, _, role = fault.worker.partition("-")  # busiest-decode: decode workers only
            workers = [w for w in self.serving.roles if w.startswith(role)]
        else:
            workers = [fault.worker]
        if not workers:
            raise LookupError(f"no worker matches {fault.worker!r}")
        best, best_running = workers[0], -1
        with anyio.move_on_after(fault.wait_s):
            while True:
                for worker in workers:
                    stats = await self.stats(worker)
                    if stats is None:
                        continue
                    # Mid-stream: a decode worker's requests may still wait for their KV.
                    prefill = self.serving.roles[worker] == "prefill"
                    busy = stats.running if prefill else stats.streaming
                    if busy > best_running:
                        best, best_running = worker, busy
                if best_running >= fault.when_busy:
                    return best, None
                best_running = -1
                await anyio.sleep(0.01)
        return best, f"no worker ran {fault.when_busy} requests within {fault.wait_s} s"

    async def pid(self, worker: str) -> int:
        stats = await self.stats(worker)
        if stats is None or not stats.pid:
            raise LookupError(f"the engine of {worker!r} is not answering")
        return stats.pid


Injector = Callable[[Any, Target, FaultRecord], Awaitable[None]]
_INJECTORS: dict[type[Fault], Injector] = {}


def register_injector(cls: type[Fault]) -> Callable[[Injector], Injector]:
    """Declare the coroutine that carries out faults of type ``cls``."""

    def decorate(fn: Injector) -> Injector:
        _INJECTORS[cls] = fn
        return fn

    return decorate


async def inject(fault: Fault, target: Target) -> FaultRecord:
    """Wait until the fault is due, carry it out, and say what happened."""
    record = FaultRecord(
        kind=fault.kind, description=fault.describe(), target=fault.target, at=fault.at
    )
    await anyio.sleep(max(0.0, fault.at - target.clock.now()))
    try:
        if isinstance(fault, _WorkerFault):
            record.target, record.error = await target.busy_worker(fault)
        await _INJECTORS[type(fault)](fault, target, record)
    except Exception as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    if record.injected_at is None and record.error is None:
        record.error = "not injected"
    record.ended_at = target.clock.now()
    return record


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass  # gone already: what the fault wanted


@register_injector(KillEngine)
async def _kill(fault: KillEngine, target: Target, record: FaultRecord) -> None:
    pid = await target.pid(record.target)
    os.kill(pid, signal.Signals[fault.signal])
    record.injected_at = target.clock.now()
    record.detail = f"{fault.signal} to engine pid {pid}"


@register_injector(StallEngine)
async def _stall(fault: StallEngine, target: Target, record: FaultRecord) -> None:
    pid = await target.pid(record.target)
    os.kill(pid, signal.SIGSTOP)
    record.injected_at = target.clock.now()
    try:
        await anyio.sleep(fault.duration_s)
    finally:
        # Never leave a stopped process behind, even when the run is cancelled.
        _signal(pid, signal.SIGCONT)
    record.detail = f"SIGSTOP engine pid {pid}, SIGCONT after {fault.duration_s} s"


async def _perturb(target: Target, worker: str, action: str, factor: float = 1.0) -> None:
    await target.engine(worker).ask(control.Perturb(action, factor), timeout=5.0)


@register_injector(CrashEngine)
async def _crash(fault: CrashEngine, target: Target, record: FaultRecord) -> None:
    record.injected_at = target.clock.now()
    try:
        await _perturb(target, record.target, "crash")
    except ActorError as exc:
        record.detail = f"the engine actor crashed: {type(exc).__name__}"
        return
    record.error = "the engine actor answered instead of crashing"


@register_injector(HangEngine)
async def _hang(fault: HangEngine, target: Target, record: FaultRecord) -> None:
    await _perturb(target, record.target, "hang")
    record.injected_at = target.clock.now()
    record.detail = "generation stopped; the process still answers"
    if fault.duration_s is not None:
        await anyio.sleep(fault.duration_s)
        try:
            await _perturb(target, record.target, "unhang")
        except ActorError:
            record.detail += "; restarted before it was unhung"


@register_injector(SlowEngine)
async def _slow(fault: SlowEngine, target: Target, record: FaultRecord) -> None:
    await _perturb(target, record.target, "slow", fault.factor)
    record.injected_at = target.clock.now()
    record.detail = f"{fault.factor:g}x slower"
    if fault.duration_s is not None:
        await anyio.sleep(fault.duration_s)
        await _perturb(target, record.target, "slow", 1.0)
        record.detail += f" for {fault.duration_s} s"


@register_injector(FailCanaries)
async def _fail_canaries(fault: FailCanaries, target: Target, record: FaultRecord) -> None:
    await target.engine(record.target).ask(control.InjectFault("health", fault.count))
    record.injected_at = target.clock.now()
    record.detail = f"next {fault.count} canaries fail"


@register_injector(FailGenerate)
async def _fail_generate(fault: FailGenerate, target: Target, record: FaultRecord) -> None:
    await target.engine(record.target).ask(control.InjectFault("generate", fault.count))
    record.injected_at = target.clock.now()
    record.detail = f"next {fault.count} requests fail before their first token"


@register_injector(FailKvTransfer)
async def _fail_kv(fault: FailKvTransfer, target: Target, record: FaultRecord) -> None:
    operation = "corrupt_kv" if fault.corrupt else "fail_kv"
    await target.engine(record.target).ask(control.InjectFault(operation, fault.count))
    record.injected_at = target.clock.now()
    what = "arrive corrupted" if fault.corrupt else "fail"
    record.detail = f"next {fault.count} KV transfers into it {what}"


@register_injector(DropPublisher)
async def _drop_publisher(fault: DropPublisher, target: Target, record: FaultRecord) -> None:
    worker = await target.worker_supervisor(record.target)
    publisher = await worker.child("publisher")
    await publisher.ask("drop_sockets")
    record.injected_at = target.clock.now()
    record.detail = "publisher's ZMQ subscriptions closed"


@register_injector(CrashLoop)
async def _crash_loop(fault: CrashLoop, target: Target, record: FaultRecord) -> None:
    if target.fail_start_file is None:
        raise RuntimeError("the topology has no fail_start_file (a mock engine is needed)")
    # The target's own count: another worker restarting meanwhile must start normally.
    own = anyio.Path(str(target.fail_start_file).replace("{worker}", record.target))
    await own.write_text(str(fault.failures))
    pid = await target.pid(record.target)
    os.kill(pid, signal.SIGKILL)
    record.injected_at = target.clock.now()
    record.detail = f"SIGKILL engine pid {pid}; its next {fault.failures} starts fail"


@register_injector(CancelRequest)
async def _cancel(fault: CancelRequest, target: Target, record: FaultRecord) -> None:
    req = RequestRecord(id=f"cancel-{fault.phase}-{len(target.extra)}", group="cancel")
    target.extra.append(req)
    prompt = f"cancel me in {fault.phase}: " + "x" * fault.prompt_chars
    body = request_body(target.workload, target.model, prompt, fault.max_tokens)
    before = COUNTERS["cancellations"](await scrape(target.client))
    config = target.serving.config
    await send_and_hang_up(
        config.host,
        target.port,
        body,
        req,
        target.clock,
        after_first_token=fault.phase == "decode",
        after_s=fault.after_s,
    )
    if not req.cancelled:
        record.error = f"the request ended before it could be cancelled ({req.error or 'done'})"
        return
    req.cancel_phase = "decode" if req.first_token is not None else "before first token"
    record.injected_at = req.ended
    if fault.phase != "decode" and req.first_token is not None:
        record.error = f"meant to cancel in {fault.phase}, but a token had arrived"
        return
    # The disconnect must reach the server: its request stream counts the cancellation.
    with anyio.move_on_after(5.0):
        # Polling: the count lives behind HTTP, there is nothing to wait on.
        while COUNTERS["cancellations"](await scrape(target.client)) <= before:  # noqa: ASYNC110
            await anyio.sleep(0.02)
        record.detail = (
            f"disconnected {req.cancel_phase}; the server counted it after "
            f"{target.clock.now() - (req.ended or 0.0):.3f} s"
        )
        return
    record.error = "the server never counted the cancellation"


@register_injector(Burst)
async def _burst(fault: Burst, target: Target, record: FaultRecord) -> None:
    burst = [
        RequestRecord(id=f"burst-{len(target.extra)}-{i}", group="burst")
        for i in range(fault.requests)
    ]
    target.extra.extend(burst)
    record.injected_at = target.clock.now()
    async with anyio.create_task_group() as tg:
        for i, req in enumerate(burst):
            prompt = target.workload.prompt(1000 + i, 0)[: fault.prompt_chars + 40]
            body = request_body(target.workload, target.model, prompt, fault.max_tokens)
            tg.start_soon(send, target.client, req, body, target.clock)
    refused = sum(r.status == 503 for r in burst)
    record.detail = f"{fault.requests} at once: {sum(r.ok for r in burst)} served, {refused} 503"
