"""Lifecycle faults: worker drain, memory release/resume (one worker, or rolling over a pool)
through the root's lifecycle actor, and a signal to a root running as its own process."""

from __future__ import annotations

import signal
from typing import Any, ClassVar, Literal

import anyio
import attrs

from actors import ActorRef, current_registry
from actors.serving.root import DrainWorker, Release, Resume, UndrainWorker
from protocols.engine import MemoryTag
from scenarios._faults_model import Fault, _WorkerFault, register_fault
from scenarios._inject import FaultRecord, Target, register_injector
from scenarios._metrics import gauge
from scenarios._subprocess import DRAIN_S

__all__ = ["DrainAndUndrain", "ReleaseAndResume", "RollingRelease", "SignalRoot"]

_LIFECYCLE = "lifecycle"  # the lifecycle actor's registered name (actors.serving.root._root)
_ACTIVE = "actorserve_frontend_active_requests"


def _tags(value: Any) -> tuple[str, ...]:
    tags = (value,) if isinstance(value, str) else tuple(value)
    for tag in tags:
        MemoryTag(tag)  # ValueError for an unknown tag, at declaration
    return tags


@register_fault
@attrs.frozen(kw_only=True)
class ReleaseAndResume(_WorkerFault):
    """Release the worker's memory (``tags``, default: KV cache and weights) through the
    lifecycle: unregister, hand in-flight requests over, pause, release; resume
    ``resume_after_s`` later."""

    kind: ClassVar[str] = "release"
    tags: tuple[str, ...] = attrs.field(default=(), converter=_tags)
    resume_after_s: float = 0.5


@register_fault
@attrs.frozen(kw_only=True)
class RollingRelease(Fault):
    """Release and resume every worker of ``pool``, one at a time (N-1 keep serving)."""

    kind: ClassVar[str] = "rolling_release"
    pool: Literal["decode", "prefill"] = "decode"
    tags: tuple[str, ...] = attrs.field(default=(), converter=_tags)

    @property
    def target(self) -> str:
        return f"{self.pool} pool"


@register_fault
@attrs.frozen(kw_only=True)
class DrainAndUndrain(_WorkerFault):
    """Drain the worker (unregister, hand its requests over), undrain it ``undrain_after_s``
    later (``None``: it stays drained)."""

    kind: ClassVar[str] = "drain"
    undrain_after_s: float | None = 0.5


@register_fault
@attrs.frozen(kw_only=True)
class SignalRoot(Fault):
    """Signal the root process (the scenario runs it as ``actorserve run`` in a child
    process): SIGTERM or SIGINT start the staged graceful shutdown. Fires once the frontend has
    ``when_inflight`` requests in flight."""

    kind: ClassVar[str] = "signal_root"
    signal: Literal["SIGTERM", "SIGINT"] = "SIGTERM"
    when_inflight: int = 0
    wait_s: float = 10.0

    @property
    def target(self) -> str:
        return "root"


def _lifecycle() -> ActorRef[Any]:
    ref = current_registry().whereis(_LIFECYCLE)
    if ref is None:
        raise LookupError("this tree has no lifecycle actor")
    return ref


def _memory_tags(tags: tuple[str, ...]) -> tuple[MemoryTag, ...]:
    return tuple(MemoryTag(t) for t in tags)


@register_injector(ReleaseAndResume)
async def _release(fault: ReleaseAndResume, target: Target, record: FaultRecord) -> None:
    lifecycle = _lifecycle()
    tags = _memory_tags(fault.tags)
    record.injected_at = target.clock.now()
    await lifecycle.ask(Release(worker=record.target, tags=tags), timeout=None)
    stats = await target.stats(record.target)
    released = sorted(t.value for t in stats.released) if stats is not None else []
    if not released:
        record.error = "the engine reports no released memory after the release"
        return
    released_at = target.clock.now() - record.injected_at
    await anyio.sleep(fault.resume_after_s)
    await lifecycle.ask(Resume(worker=record.target, tags=tags), timeout=None)
    record.detail = (
        f"released {', '.join(released)} after {released_at:.2f} s; resumed "
        f"{fault.resume_after_s} s later"
    )


@register_injector(RollingRelease)
async def _rolling(fault: RollingRelease, target: Target, record: FaultRecord) -> None:
    record.injected_at = target.clock.now()
    release = Release(pool=fault.pool, tags=_memory_tags(fault.tags), rolling=True)
    await _lifecycle().ask(release, timeout=None)
    took = target.clock.now() - record.injected_at
    record.detail = f"every {fault.pool} worker released and resumed in turn, in {took:.2f} s"


@register_injector(DrainAndUndrain)
async def _drain(fault: DrainAndUndrain, target: Target, record: FaultRecord) -> None:
    lifecycle = _lifecycle()
    record.injected_at = target.clock.now()
    await lifecycle.ask(DrainWorker(record.target), timeout=None)
    record.detail = f"drained in {target.clock.now() - record.injected_at:.2f} s"
    if fault.undrain_after_s is not None:
        await anyio.sleep(fault.undrain_after_s)
        await lifecycle.ask(UndrainWorker(record.target))
        record.detail += f", undrained {fault.undrain_after_s} s later"


@register_injector(SignalRoot)
async def _signal_root(fault: SignalRoot, target: Target, record: FaultRecord) -> None:
    root = target.root_process
    if root is None:
        raise RuntimeError("signal_root needs the root in its own process (process='subprocess')")
    if fault.when_inflight:
        with anyio.move_on_after(fault.wait_s) as scope:
            # Polling: the gauge lives behind HTTP, there is nothing to wait on.
            while await gauge(target.client, _ACTIVE) < fault.when_inflight:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        if scope.cancelled_caught:
            record.error = f"never {fault.when_inflight} requests in flight within {fault.wait_s} s"
    root.collect_pids()
    root.process.send_signal(signal.Signals[fault.signal])
    record.injected_at = target.clock.now()
    with anyio.move_on_after(DRAIN_S + 30):
        root.exit_code = await root.process.wait()
    root.exited_after_s = target.clock.now() - record.injected_at
    if root.exit_code is None:
        record.error = f"the root still runs {root.exited_after_s:.1f} s after {fault.signal}"
        return
    record.detail = (
        f"{fault.signal}: the root exited with code {root.exit_code} "
        f"after {root.exited_after_s:.2f} s"
    )
