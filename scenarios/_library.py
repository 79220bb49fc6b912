"""The scenario library: the failures users of a serving runtime fear, each with what must hold.

Modelled on Dynamo's fault-tolerance suite (worker kill mid-stream with migration, engine stall,
cancellation, overload, crash loops), run against mock engines in child processes. Time bounds
are generous ceilings (Dynamo allows 60 s of recovery with redundancy, 180 s without); ours are
scaled to the mock's speed-up and still catch a hang or a lost request, never a slow machine.
"""

from __future__ import annotations

from collections.abc import Callable

from scenarios._faults_model import FailKvTransfer, KillEngine
from scenarios._library_workers import GAP_S, RECOVERY_S, SLOWER, STREAMING, WORKER_SCENARIOS
from scenarios._lifecycle import DrainAndUndrain, ReleaseAndResume, RollingRelease, SignalRoot
from scenarios._model import Bound, Expect, Scenario, Workload, topology

__all__ = ["LIBRARY", "get_scenario", "library"]


def _root_sigterm() -> Scenario:
    return Scenario(
        name="root-sigterm-under-load",
        description="SIGTERM to the root process (actorserve run) under load: it stops "
        "admitting (503), drains what is in flight with the fault-free tokens, cleans its "
        "engines up and exits 0; later clients find the port closed. No stream is cut.",
        topology=topology(decode_workers=2, engine_args=SLOWER),
        workload=Workload(clients=4, requests_per_client=4, max_tokens=160, retries=1),
        faults=(SignalRoot(at=0.05, when_inflight=4),),
        expect=Expect(
            success_rate=0.25,  # the 4 requests in flight at the signal, at least
            # Refused: the port closed, the connection dropped before an answer, or a 503
            # while draining. Never "transport: cut mid-stream".
            allowed_errors=(
                "transport: ConnectError",
                "transport: ReadError",
                "transport: RemoteProtocolError",
                "backend.worker_draining",
            ),
            root_exit_code=0,
        ),
        process="subprocess",
    )


def _release_resume() -> Scenario:
    return Scenario(
        name="release-resume-under-load",
        description="Release the busiest worker's KV cache and weights under load (unregister, "
        "hand its requests over, pause, release), resume half a second later: nothing fails, "
        "nothing restarts, the worker serves again.",
        topology=topology(decode_workers=2, router="round_robin", engine_args=SLOWER),
        workload=STREAMING,
        faults=(ReleaseAndResume(at=0.05, when_busy=2, resume_after_s=0.5),),
        expect=Expect(
            max_token_gap_s=GAP_S,
            counters={
                "releases": 1,
                "resumes": 1,
                "migrations": Bound(min=1),
                "lifecycle_failures": 0,
                "engine_restarts": 0,
            },
        ),
    )


def _rolling_release() -> Scenario:
    return Scenario(
        name="rolling-release-under-load",
        description="Release and resume every decode worker one at a time under load: one "
        "always serves, so no request fails and none waits on an empty pool.",
        topology=topology(decode_workers=2, router="round_robin", engine_args=SLOWER),
        workload=Workload(clients=4, requests_per_client=6, max_tokens=120),
        faults=(RollingRelease(at=0.05),),
        expect=Expect(
            max_token_gap_s=GAP_S,
            counters={"releases": 2, "resumes": 2, "lifecycle_failures": 0, "engine_restarts": 0},
        ),
    )


def _drain() -> Scenario:
    return Scenario(
        name="drain-worker-under-load",
        description="Drain the busiest worker under load (its requests are handed over with a "
        "migratable error, never a 'cancelled' finish), undrain it half a second later.",
        topology=topology(decode_workers=2, router="round_robin", engine_args=SLOWER),
        # Streams long enough to outlast the drain's grace period, so some are handed over.
        workload=Workload(clients=6, requests_per_client=2, max_tokens=400),
        faults=(DrainAndUndrain(at=0.05, when_busy=2, undrain_after_s=0.5),),
        expect=Expect(
            max_token_gap_s=GAP_S,
            counters={"drains": Bound(min=1), "migrations": Bound(min=1), "engine_restarts": 0},
        ),
    )


_DISAGG: dict[str, object] = {"mode": "disaggregated", "prefill_workers": 1, "decode_workers": 2}


def _disagg_decode_kill() -> Scenario:
    return Scenario(
        name="disagg-decode-killed-mid-stream",
        description="Disaggregated (1 prefill, 2 decode, KV over NIXL): SIGKILL the busiest "
        "decode worker mid-stream; its streams migrate (re-prefilled) with the fault-free "
        "tokens.",
        topology=topology(**_DISAGG, router="round_robin", engine_args=SLOWER),
        workload=STREAMING,
        faults=(KillEngine(worker="busiest-decode", at=0.05, when_busy=2),),
        expect=Expect(
            max_token_gap_s=GAP_S,
            max_recovery_s=RECOVERY_S,
            counters={"migrations_ongoing": Bound(min=1), "engine_restarts": Bound(min=1)},
        ),
    )


def _disagg_prefill_kill() -> Scenario:
    return Scenario(
        name="disagg-prefill-killed-mid-transfer",
        description="Disaggregated (2 prefill, 2 decode): SIGKILL a prefill worker while it "
        "prefills or still owes KV: the decode side's transfer fails, the request is "
        "re-dispatched, every client gets the fault-free tokens.",
        # Real-time prefill of 3000-token prompts (about 70 ms each): long enough to be caught.
        topology=topology(
            **{**_DISAGG, "prefill_workers": 2},
            router="round_robin",
            engine_args={"timing": {"speedup": 1.0}},
        ),
        workload=Workload(clients=4, requests_per_client=3, max_tokens=16, prompt_chars=3000),
        faults=(KillEngine(worker="busiest-prefill", at=0.05, when_busy=1),),
        expect=Expect(
            max_recovery_s=RECOVERY_S,
            counters={"migrations": Bound(min=1), "engine_restarts": Bound(min=1)},
        ),
    )


def _kv_transfer(corrupt: bool) -> Scenario:
    what = "arrive corrupted (a flipped byte)" if corrupt else "fail"
    return Scenario(
        name="kv-transfer-corrupted" if corrupt else "kv-transfer-fails",
        description=f"Disaggregated: a decode worker's next 2 KV transfers {what}; "
        + ("its page verification catches it, " if corrupt else "")
        + "each request is re-dispatched and completes with the fault-free tokens.",
        topology=topology(**_DISAGG, router="round_robin"),
        workload=Workload(clients=4, requests_per_client=3, max_tokens=32),
        faults=(FailKvTransfer(worker="decode-0", count=2, corrupt=corrupt),),
        # Ongoing: the client had its first token already (the prefill's, sent before the KV
        # crossed over), which migrates with the request.
        expect=Expect(counters={"migrations_ongoing": Bound(min=2), "engine_restarts": 0}),
    )


_BUILDERS: list[Callable[[], Scenario]] = [
    *WORKER_SCENARIOS,
    _root_sigterm,
    _release_resume,
    _rolling_release,
    _drain,
    _disagg_decode_kill,
    _disagg_prefill_kill,
    lambda: _kv_transfer(corrupt=False),
    lambda: _kv_transfer(corrupt=True),
]

LIBRARY: dict[str, Scenario] = {s.name: s for s in (build() for build in _BUILDERS)}


def library() -> list[Scenario]:
    """Every library scenario, in a stable order."""
    return list(LIBRARY.values())


def get_scenario(name: str) -> Scenario:
    """The library scenario called ``name`` (``KeyError`` listing the names if none)."""
    try:
        return LIBRARY[name]
    except KeyError:
        raise KeyError(f"no scenario {name!r}; try one of: {', '.join(LIBRARY)}") from None
