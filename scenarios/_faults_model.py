"""The faults a scenario can inject, as declarations (``scenarios._inject`` carries them out).

Every fault fires ``at`` seconds after the faulted workload starts; a fault aimed at a worker
first waits (up to ``wait_s``) until that worker's engine streams at least ``when_busy``
requests (a prefill worker's: runs them; its one output comes at the end), so "killed
mid-stream" means mid-stream on a slow or a fast machine alike. ``worker="busiest"`` picks the
worker with the most such requests at that moment (``"busiest-decode"``,
``"busiest-prefill"``: among the workers of that role).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import attrs

__all__ = [
    "FAULT_KINDS",
    "Burst",
    "CancelRequest",
    "CrashEngine",
    "CrashLoop",
    "DropPublisher",
    "FailCanaries",
    "FailGenerate",
    "FailKvTransfer",
    "Fault",
    "HangEngine",
    "KillEngine",
    "SlowEngine",
    "StallEngine",
]


@attrs.frozen(kw_only=True)
class Fault:
    """Base of every fault: ``at`` seconds after the faulted workload starts."""

    kind: ClassVar[str] = ""
    at: float = 0.0

    @property
    def target(self) -> str:
        return str(getattr(self, "worker", "-"))

    def describe(self) -> str:
        """One line for tables and plots."""
        fields = {
            a.name: getattr(self, a.name)
            for a in attrs.fields(type(self))
            if a.name not in ("at", "worker")
        }
        args = ", ".join(f"{k}={v}" for k, v in fields.items())
        return f"{self.kind}({args})" if args else self.kind


@attrs.frozen(kw_only=True)
class _WorkerFault(Fault):
    worker: str = "busiest"
    when_busy: int = 0  # wait until the worker streams (prefill: runs) this many requests
    wait_s: float = 10.0


@attrs.frozen(kw_only=True)
class KillEngine(_WorkerFault):
    """Signal the worker's engine process: SIGKILL (death) or SIGTERM (graceful stop)."""

    kind: ClassVar[str] = "kill"
    signal: Literal["SIGKILL", "SIGTERM"] = "SIGKILL"


@attrs.frozen(kw_only=True)
class StallEngine(_WorkerFault):
    """SIGSTOP the engine process, SIGCONT it ``duration_s`` later (if it still exists)."""

    kind: ClassVar[str] = "stall"
    duration_s: float = 3.0


@attrs.frozen(kw_only=True)
class CrashEngine(_WorkerFault):
    """An exception raised inside the engine actor's handler: the actor crashes."""

    kind: ClassVar[str] = "crash"


@attrs.frozen(kw_only=True)
class HangEngine(_WorkerFault):
    """Generation stops while the process lives on and answers heartbeats (a hung GPU);
    ``duration_s`` ends it, ``None`` leaves it to the health checker."""

    kind: ClassVar[str] = "hang"
    duration_s: float | None = None


@attrs.frozen(kw_only=True)
class SlowEngine(_WorkerFault):
    """Every engine step takes ``factor`` times as long, for ``duration_s`` (``None``: for
    the rest of the run)."""

    kind: ClassVar[str] = "slow"
    factor: float = 10.0
    duration_s: float | None = None


@attrs.frozen(kw_only=True)
class FailCanaries(_WorkerFault):
    """The worker's next ``count`` health canaries fail."""

    kind: ClassVar[str] = "fail_canaries"
    count: int = 3


@attrs.frozen(kw_only=True)
class FailGenerate(_WorkerFault):
    """The worker's next ``count`` generation requests fail before their first token."""

    kind: ClassVar[str] = "fail_generate"
    count: int = 1


@attrs.frozen(kw_only=True)
class FailKvTransfer(_WorkerFault):
    """The decode worker's next ``count`` KV transfers (disaggregated serving) fail
    (``corrupt=False``) or arrive corrupted, one flipped byte that verification must catch."""

    kind: ClassVar[str] = "kv_transfer"
    worker: str = "decode-0"
    count: int = 1
    corrupt: bool = False


@attrs.frozen(kw_only=True)
class DropPublisher(_WorkerFault):
    """Close the ZMQ subscriptions of the worker's publisher under it."""

    kind: ClassVar[str] = "drop_publisher"


@attrs.frozen(kw_only=True)
class CrashLoop(_WorkerFault):
    """Kill the engine, and make its next ``failures`` starts fail."""

    kind: ClassVar[str] = "crash_loop"
    failures: int = 2


@attrs.frozen(kw_only=True)
class CancelRequest(Fault):
    """A client of its own sends a request and disconnects in ``phase``.

    ``decode``: after its first token. ``prefill`` and ``queued``: ``after_s`` after sending,
    before any token (a long prompt makes prefill last; a saturated engine, through the
    topology's ``max_running_requests``, makes the request queue). The report says which phase
    the client actually saw.
    """

    kind: ClassVar[str] = "cancel"
    phase: Literal["queued", "prefill", "decode"] = "decode"
    prompt_chars: int = 64
    max_tokens: int = 400
    after_s: float = 0.1


@attrs.frozen(kw_only=True)
class Burst(Fault):
    """``requests`` extra requests at once (no retries): beyond ``max_inflight`` they must be
    refused with 503 and ``Retry-After``."""

    kind: ClassVar[str] = "burst"
    requests: int = 16
    prompt_chars: int = 48
    max_tokens: int = 64


FAULT_KINDS: dict[str, type[Fault]] = {
    cls.kind: cls
    for cls in (
        KillEngine,
        StallEngine,
        CrashEngine,
        HangEngine,
        SlowEngine,
        FailCanaries,
        FailGenerate,
        FailKvTransfer,
        DropPublisher,
        CrashLoop,
        CancelRequest,
        Burst,
    )
}


def register_fault(cls: type[Fault]) -> type[Fault]:
    """Make a fault class loadable by its ``kind`` (``scenarios._lifecycle`` adds its own)."""
    FAULT_KINDS[cls.kind] = cls
    return cls


def fault_from_dict(data: dict[str, Any]) -> Fault:
    """The fault a TOML/YAML table declares: ``kind`` plus the class's fields."""
    data = dict(data)
    kind = data.pop("kind", None)
    cls = FAULT_KINDS.get(str(kind))
    if cls is None:
        raise ValueError(f"unknown fault kind {kind!r} (one of {', '.join(sorted(FAULT_KINDS))})")
    try:
        return cls(**data)
    except TypeError as exc:
        raise ValueError(f"fault {kind!r}: {exc}") from None


def fault_to_dict(fault: Fault) -> dict[str, Any]:
    return {"kind": fault.kind, **attrs.asdict(fault)}
