"""What a scenario declares: topology, workload, timed faults and expectations.

Everything here is a frozen attrs class, so a scenario is a plain value: build it in Python, or
load it from TOML/YAML (``scenarios.load_scenario``), print it, put it in a report.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import attrs

from actors.serving import ServeConfig
from scenarios._faults_model import Fault

__all__ = ["FAST_ENGINE", "Bound", "Expect", "Scenario", "Workload", "topology"]

# Engine arguments that keep a scenario quick on a small CPU box: the mock's timing model sped up
# 20x, a small paged KV pool. A scenario's own ``engine_args`` win over these.
FAST_ENGINE: dict[str, Any] = {
    "timing": {"speedup": 20.0},
    "num_blocks": 2048,
    "block_size": 16,
    "context_length": 4096,
    "kv_bytes_per_block": 256,
    "weights_bytes": 1 << 20,
}

# Serving defaults for scenarios: an ephemeral loopback port, and detection times scaled to CI
# (a hung process is killed after 2 s without heartbeats, a stalled stream migrates after 4 s:
# short enough for a quick suite, long enough that a busy small machine does not trip them).
_FAST_SERVE: dict[str, Any] = {
    "backend": "mock",  # ServeConfig's own defaults serve a real model, disaggregated
    "mode": "aggregated",
    "port": 0,
    "host": "127.0.0.1",
    "heartbeat_timeout": 2.0,
    "stall_timeout": 4.0,
    "request_timeout": 60.0,
    "health_idle_after": 0.3,
    "health_timeout": 0.5,
    "health_failures": 2,
}


def topology(**overrides: Any) -> ServeConfig:
    """A :class:`~actors.serving.ServeConfig` with the scenario defaults (fast mock engines,
    short detection times, an ephemeral port on 127.0.0.1) under ``overrides``;
    ``engine_args`` are merged over :data:`FAST_ENGINE`."""
    engine_args = {**FAST_ENGINE, **overrides.pop("engine_args", {})}
    return ServeConfig(**{**_FAST_SERVE, **overrides, "engine_args": engine_args})


@attrs.frozen(kw_only=True)
class Workload:
    """Closed-loop clients over HTTP: each sends its requests one after another.

    Prompts are a deterministic function of (``seed``, client, request), and ``temperature`` 0
    makes every answer deterministic, so a faulted run can be compared token for token with a
    fault-free one. A 503 before any output is retried after its ``Retry-After`` (capped, so CI
    stays quick), as OpenAI's client does.
    """

    clients: int = 4
    requests_per_client: int = 4
    prompt_chars: int = 48
    max_tokens: int = 64
    stream: bool = True
    temperature: float = 0.0
    seed: int = 0
    think_s: float = 0.0  # pause between two requests of a client
    retries: int = 3  # on 503 with Retry-After
    retry_after_cap_s: float = 0.2
    timeout_s: float = 60.0

    def __attrs_post_init__(self) -> None:
        if self.clients < 0 or self.requests_per_client < 0 or self.max_tokens < 1:
            raise ValueError("workload needs clients >= 0, requests >= 0, max_tokens >= 1")

    @property
    def total(self) -> int:
        return self.clients * self.requests_per_client

    def prompt(self, client: int, index: int) -> str:
        """The prompt of request ``index`` of ``client``."""
        head = f"[{self.seed}] client {client} request {index}: "
        filler = "tell me a long story about actors and supervisors. "
        body = (filler * (self.prompt_chars // len(filler) + 1))[: max(0, self.prompt_chars)]
        return head + body


@attrs.frozen
class Bound:
    """An inclusive range for a counter; ``None`` leaves that side open."""

    min: float | None = None
    max: float | None = None

    def holds(self, value: float) -> bool:
        return (self.min is None or value >= self.min) and (self.max is None or value <= self.max)

    def __str__(self) -> str:
        if self.min is not None and self.max is not None:
            return f"{self.min:g}" if self.min == self.max else f"{self.min:g}..{self.max:g}"
        if self.min is not None:
            return f">= {self.min:g}"
        return f"<= {self.max:g}" if self.max is not None else "any"


def _faults(value: Iterable[Fault]) -> tuple[Fault, ...]:
    return tuple(value)


def _strings(value: Iterable[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def _bounds(value: Any) -> dict[str, Bound]:
    out: dict[str, Bound] = {}
    for key, bound in dict(value).items():
        if isinstance(bound, Bound):
            out[key] = bound
        elif isinstance(bound, int | float):
            out[key] = Bound(bound, bound)  # a number means exactly that many
        else:
            out[key] = Bound(**bound)
    return out


@attrs.frozen(kw_only=True)
class Expect:
    """What must hold after the faulted run.

    Time bounds (``max_token_gap_s``, ``max_recovery_s``) are generous ceilings in the spirit of
    Dynamo's fault-tolerance checkers (recovery within 60 s with redundancy), scaled to the mock's
    speed-up; they catch a hang or a lost request, not a slow machine.

    ``counters`` bound what the run counted (see ``scenarios.COUNTERS``), e.g.
    ``{"migrations": Bound(min=1), "escalations": 0}``.
    """

    success_rate: float = 1.0  # of workload requests, at least
    tokens_match_baseline: bool = True  # every succeeded request equals the fault-free run
    max_token_gap_s: float | None = None
    max_recovery_s: float | None = None
    counters: dict[str, Bound] = attrs.field(factory=dict, converter=_bounds)
    escalation: bool | None = False  # some supervisor gave up and escalated (None: either way)
    # Error codes a failed workload request may end with (empty: any); e.g. with migration off,
    # a killed worker's requests must fail with a typed ``request.migration_exhausted``.
    allowed_errors: tuple[str, ...] = attrs.field(default=(), converter=_strings)
    faults_injected: bool = True  # every fault actually happened
    no_leaks: bool = True  # tasks, processes, sockets, KV blocks
    root_exit_code: int | None = None  # a root in its own process must have exited with it


@attrs.frozen(kw_only=True)
class Scenario:
    """A topology, a workload, faults at times relative to the workload's start, expectations."""

    name: str
    description: str = ""
    topology: ServeConfig = attrs.field(factory=topology)
    workload: Workload = attrs.field(factory=Workload)
    faults: tuple[Fault, ...] = attrs.field(default=(), converter=_faults)
    expect: Expect = attrs.field(factory=Expect)
    baseline: bool = True  # run the workload fault-free first (token comparison)
    settle_s: float = 15.0  # after the load: how long workers get to be routable again
    # Where the root runs: in this process (faults reach every actor), or as ``actorserve run``
    # in a child process (for faults aimed at the root process itself: only root signals,
    # bursts and client cancellations reach it there).
    process: Literal["in_process", "subprocess"] = "in_process"

    def __attrs_post_init__(self) -> None:
        if self.process == "subprocess":
            reach = ("signal_root", "burst", "cancel")
            beyond = [f.kind for f in self.faults if f.kind not in reach]
            if beyond:
                raise ValueError(
                    f"faults {beyond} need the root in this process (process='in_process')"
                )
