"""Library scenarios about one worker's failures (aggregated serving): deaths, stalls, hangs,
crashes, crash loops, canaries, publishers, cancellations, overload, slow engines.

Shared by the library: the workloads and the generous time bounds (see ``scenarios._library``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from scenarios._faults_model import (
    Burst,
    CancelRequest,
    CrashEngine,
    CrashLoop,
    DropPublisher,
    FailCanaries,
    FailGenerate,
    Fault,
    HangEngine,
    KillEngine,
    SlowEngine,
    StallEngine,
)
from scenarios._model import Bound, Expect, Scenario, Workload, topology

__all__ = ["GAP_S", "RECOVERY_S", "SLOWER", "STREAMING", "WORKER_SCENARIOS"]

# Long enough streams that a fault lands mid-stream: 160 tokens at a 5x speed-up.
STREAMING = Workload(clients=6, requests_per_client=3, max_tokens=160)
SLOWER = {"timing": {"speedup": 5.0}}
GAP_S = 5.0  # longest silence a client may see while its stream moves to another worker
RECOVERY_S = 30.0


def _migrating(
    name: str,
    description: str,
    fault: Fault,
    *,
    migrate: bool = True,
    stall_timeout: float = 4.0,
    **counters: Bound | int,
) -> Scenario:
    """Two aggregated workers, long streams, one fault on the busiest: every stream completes
    with exactly the fault-free tokens (``migrate``: some of them on the other worker)."""
    if migrate:
        counters = {"migrations_ongoing": Bound(min=1), **counters}
    return Scenario(
        name=name,
        description=description,
        topology=topology(
            decode_workers=2,
            router="round_robin",
            engine_args=SLOWER,
            stall_timeout=stall_timeout,
        ),
        workload=STREAMING,
        faults=(fault,),
        expect=Expect(max_token_gap_s=GAP_S, max_recovery_s=RECOVERY_S, counters=counters),
    )


def _kill() -> Scenario:
    return _migrating(
        "decode-killed-mid-stream",
        "SIGKILL the busiest of two aggregated workers mid-stream: its streams migrate and "
        "complete with the fault-free tokens; the engine restarts.",
        KillEngine(at=0.05, when_busy=2),
        engine_restarts=Bound(min=1),
    )


def _sigterm() -> Scenario:
    return _migrating(
        "decode-sigterm-mid-stream",
        "SIGTERM the busiest engine mid-stream: it stops gracefully (its streams finish, or "
        "end with a migratable error, never a 'cancelled' finish) and restarts; every client "
        "gets the fault-free tokens.",
        KillEngine(at=0.05, when_busy=2, signal="SIGTERM"),
        migrate=False,
        engine_restarts=Bound(min=1),
    )


def _stall() -> Scenario:
    return _migrating(
        "engine-stalled-sigstop",
        "SIGSTOP the busiest engine for 4 s: 2 s without heartbeats get it killed and "
        "restarted, its streams migrate; SIGCONT finds it gone.",
        StallEngine(at=0.05, when_busy=2, duration_s=4.0),
        engine_restarts=Bound(min=1),
    )


def _crash() -> Scenario:
    return _migrating(
        "engine-actor-crash",
        "An exception escapes the busiest engine actor's handler: the actor (and its process) "
        "crash, the worker restarts, its streams migrate.",
        CrashEngine(at=0.05, when_busy=2),
        engine_restarts=Bound(min=1),
    )


def _publisher() -> Scenario:
    return _migrating(
        "publisher-socket-dropped",
        "The busiest worker's publisher loses its ZMQ subscriptions: it crashes, its "
        "one_for_all worker restarts engine, publisher and checker (the engine stops "
        "gracefully), then subscribes afresh; clients see nothing.",
        DropPublisher(at=0.05, when_busy=2),
        migrate=False,
        engine_restarts=Bound(min=1),
    )


def _hang() -> Scenario:
    return _migrating(
        "hung-engine-health-check",
        "Generation stops on the busiest engine while its process stays alive: streams stall "
        "and migrate, canaries on the now idle worker fail and the health checker restarts it.",
        HangEngine(at=0.05, when_busy=2),
        stall_timeout=1.5,
        engine_restarts=Bound(min=1),
        canary_failures=Bound(min=2),
    )


def _canaries() -> Scenario:
    return Scenario(
        name="canary-failures",
        description="Health canaries start failing on one worker (its requests still work): "
        "after two in a row it is taken out of routing and restarted; clients see nothing.",
        topology=topology(decode_workers=2, router="round_robin"),
        workload=Workload(clients=1, requests_per_client=14, max_tokens=16, think_s=0.3),
        faults=(FailCanaries(worker="decode-1", count=1000),),
        expect=Expect(
            counters={
                "canary_failures": Bound(min=2),
                "engine_restarts": Bound(min=1),
                "migrations": 0,
            }
        ),
    )


def _crash_loop(failures: int, escalate: bool) -> Scenario:
    if escalate:
        name = "crash-loop-escalates"
        description = (
            f"A killed engine fails its next {failures} starts: past the worker's restart "
            "intensity (3 in 60 s) the worker escalates and its pool restarts it whole."
        )
        counters: dict[str, Bound | int] = {"worker_restarts": Bound(min=1)}
    else:
        name = "crash-loop-backoff"
        description = (
            f"A killed engine fails its next {failures} starts: restarts back off (with "
            "jitter), the engine comes back, nothing escalates."
        )
        counters = {"backoffs": Bound(min=failures), "engine_restarts": Bound(min=1)}
    return Scenario(
        name=name,
        description=description,
        topology=topology(decode_workers=2, router="round_robin", engine_args=SLOWER),
        workload=Workload(clients=4, requests_per_client=4, max_tokens=120),
        faults=(CrashLoop(worker="decode-0", at=0.05, when_busy=1, failures=failures),),
        expect=Expect(
            max_recovery_s=RECOVERY_S,
            escalation=escalate,
            counters={"start_failures": Bound(min=failures), **counters},
        ),
    )


def _cancel(phase: Literal["queued", "prefill", "decode"]) -> Scenario:
    # queued: two slots, both held by the workload's long requests; prefill: a 3000-token
    # prompt on an engine slowed 20x (about a second of prefill); decode: after a token.
    engine: dict[str, object] = {"timing": {"speedup": 5.0}}
    faults: list[Fault] = []
    workload = Workload(clients=2, requests_per_client=2, max_tokens=400)
    cancel = CancelRequest(at=0.1, phase=phase)
    if phase == "queued":
        engine["max_running_requests"] = 2
    elif phase == "prefill":
        workload = Workload(clients=1, requests_per_client=2, max_tokens=16)
        faults.append(SlowEngine(worker="decode-0", factor=20.0))
        cancel = CancelRequest(at=0.1, phase="prefill", prompt_chars=3000, after_s=0.3)
    faults.append(cancel)
    return Scenario(
        name=f"cancel-{phase}",
        description=f"A client disconnects while its request is in {phase}: the engine "
        "aborts it and frees its KV blocks, nothing migrates, other clients are unaffected.",
        topology=topology(decode_workers=1, engine_args=engine),
        workload=workload,
        faults=tuple(faults),
        expect=Expect(counters={"cancellations": Bound(min=1), "cancelled": 1, "migrations": 0}),
    )


def _overload() -> Scenario:
    return Scenario(
        name="overload-503-retry-after",
        description="A burst of 24 requests on a frontend admitting 6 at a time: the excess is "
        "refused with 503 and Retry-After; clients that retry are all served.",
        topology=topology(decode_workers=2, max_inflight=6),
        # Enough requests that the workload still sends some after the burst (its recovery):
        # six each (~0.1 s in all) could all have started before it on a busy machine.
        workload=Workload(clients=3, requests_per_client=16, max_tokens=48, retries=10),
        faults=(Burst(at=0.1, requests=24),),
        expect=Expect(max_recovery_s=RECOVERY_S, counters={"rejections": Bound(min=1)}),
    )


def _slow() -> Scenario:
    return Scenario(
        name="slow-engine-is-not-dead",
        description="One engine runs 8x slower: requests on it take longer, but nothing is "
        "migrated or restarted (slow is not dead).",
        topology=topology(decode_workers=2, router="round_robin"),
        workload=Workload(clients=4, requests_per_client=3, max_tokens=64),
        faults=(SlowEngine(worker="decode-0", factor=8.0),),
        expect=Expect(counters={"migrations": 0, "engine_restarts": 0}),
    )


def _fail_generate() -> Scenario:
    return Scenario(
        name="generate-fails-before-first-token",
        description="A worker fails its next 3 requests before their first token: each is "
        "re-dispatched to the other worker as a new request.",
        topology=topology(decode_workers=2, router="round_robin"),
        workload=Workload(clients=4, requests_per_client=3, max_tokens=48),
        faults=(FailGenerate(worker="decode-0", count=3),),
        expect=Expect(counters={"migrations_new": Bound(min=3), "engine_restarts": 0}),
    )


def _no_migration() -> Scenario:
    return Scenario(
        name="migration-disabled-typed-error",
        description="With migration off, the streams of a killed worker fail with a typed "
        "'request.migration_exhausted' error; the rest are served.",
        topology=topology(
            decode_workers=2, router="round_robin", migration_limit=0, engine_args=SLOWER
        ),
        workload=STREAMING,
        faults=(KillEngine(at=0.05, when_busy=2),),
        expect=Expect(
            success_rate=0.5,
            allowed_errors=("request.migration_exhausted",),
            counters={"requests_failed": Bound(min=1), "migrations": 0},
        ),
    )


def _single_worker() -> Scenario:
    return Scenario(
        name="single-worker-killed",
        description="The only worker is killed mid-stream (no redundancy): its streams wait "
        "for the restart or fail (typed), and once it is back everything is served again.",
        topology=topology(decode_workers=1, engine_args=SLOWER),
        workload=Workload(clients=4, requests_per_client=4, max_tokens=120, retries=20),
        faults=(KillEngine(at=0.05, when_busy=2),),
        expect=Expect(
            success_rate=0.1,  # Dynamo's single-worker threshold
            max_recovery_s=RECOVERY_S,
            allowed_errors=("request.", "capacity.", "backend."),  # typed: never "internal"
            counters={"engine_restarts": Bound(min=1)},
        ),
    )


WORKER_SCENARIOS: list[Callable[[], Scenario]] = [
    _kill,
    _sigterm,
    _stall,
    _crash,
    _publisher,
    _hang,
    _canaries,
    lambda: _crash_loop(2, escalate=False),
    lambda: _crash_loop(4, escalate=True),
    lambda: _cancel("queued"),
    lambda: _cancel("prefill"),
    lambda: _cancel("decode"),
    _overload,
    _slow,
    _fail_generate,
    _no_migration,
    _single_worker,
]
