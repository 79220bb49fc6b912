"""The soak's resource samples: RSS, open descriptors and threads of the root process, of the
process actors' forkserver and of each worker's engine, read from ``/proc``; and whether each
stayed flat.

An engine's PID changes when it restarts, so samples are kept per role (``decode-0``, ...): a
fresh process is compared with the level its role had before.

Flat: after a warm-up, the median of the first 20% of the samples (the early level) and the
median of the last 20% (the late level) are compared; the late level may exceed the early one by
a tolerance (a fraction of the early level, or a floor, whichever is larger). Medians make a
burst of requests or a restart in a sample or two no step; a leak, which grows steadily, shows
as the difference between the two windows.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs
import psutil

from scenarios._inject import Target
from scenarios._workload import Clock

__all__ = ["METRICS", "Level", "Sample", "Sampler", "Tolerance", "level", "read_proc"]

METRICS = ("rss", "fds", "threads")
_WINDOW = 0.2  # each window: this fraction of the samples after the warm-up


@attrs.frozen
class Sample:
    t: float  # seconds since the load started
    pid: int
    rss: int  # bytes
    fds: int
    threads: int


def read_proc(pid: int) -> tuple[int, int, int] | None:
    """(RSS in bytes, open descriptors, threads) of ``pid``, or ``None`` if it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if "VmRSS" not in fields:
        return None  # a zombie
    rss = int(fields["VmRSS"].split()[0]) * 1024
    return rss, fds, int(fields["Threads"])


def _forkserver() -> int | None:
    for child in psutil.Process().children(recursive=True):
        try:
            if "actors.process._forkserver" in " ".join(child.cmdline()):
                return int(child.pid)
        except psutil.Error:
            continue
    return None


class Sampler:
    """Samples every role's process now and then; ``series`` holds them, by role."""

    def __init__(self, target: Target, clock: Clock) -> None:
        self.target = target
        self.clock = clock
        self.series: dict[str, list[Sample]] = {"root": [], "forkserver": []}
        self.series.update({worker: [] for worker in target.serving.roles})
        self._pids: dict[str, int] = {"root": os.getpid()}

    @property
    def count(self) -> int:
        return sum(len(samples) for samples in self.series.values())

    async def _engine_pid(self, worker: str) -> None:
        # A stopped or restarting engine does not answer: its last PID is sampled if it lives.
        stats = await self.target.stats(worker)
        if stats is not None and stats.pid:
            self._pids[worker] = stats.pid

    async def sample(self) -> None:
        """One sample of every role whose process is known and alive."""
        async with anyio.create_task_group() as tg:
            for worker in self.target.serving.roles:
                tg.start_soon(self._engine_pid, worker)
        forkserver = _forkserver()
        if forkserver is not None:
            self._pids["forkserver"] = forkserver
        t = self.clock.now()
        for role, pid in self._pids.items():
            read = read_proc(pid)
            if read is not None:
                self.series[role].append(Sample(t, pid, *read))

    async def run(self, until: float, every: float) -> None:
        """Sample every ``every`` seconds until ``until`` (on the clock), and once at the end."""
        tick = 0
        while self.clock.now() < until:
            await self.sample()
            tick += 1
            await anyio.sleep(max(0.0, min(tick * every, until) - self.clock.now()))
        await self.sample()


@attrs.frozen(kw_only=True)
class Tolerance:
    """How much the late level may exceed the early one: ``fraction`` of the early level, or
    the metric's floor, whichever is larger."""

    fraction: float = 0.10
    rss_bytes: int = 16 << 20
    fds: int = 16
    threads: int = 4

    def allowed(self, metric: str, early: float) -> float:
        floor = {"rss": self.rss_bytes, "fds": self.fds, "threads": self.threads}[metric]
        return max(float(floor), self.fraction * early)


@attrs.frozen(kw_only=True)
class Level:
    """One metric of one role over the run."""

    start: float
    end: float
    max: float
    early: float | None  # median of the first window after the warm-up
    late: float | None  # median of the last window
    allowed: float | None  # how much late may exceed early
    flat: bool
    why: str = ""  # when not flat

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def level(samples: Sequence[Sample], metric: str, warmup_s: float, tol: Tolerance) -> Level:
    """``metric`` of one role's samples, and whether it stayed flat (see the module's doc)."""
    values = [float(getattr(s, metric)) for s in samples]
    after = [float(getattr(s, metric)) for s in samples if s.t >= warmup_s]
    start, end, top = (values[0], values[-1], max(values)) if values else (0.0, 0.0, 0.0)
    if len(after) < 2:
        why = f"{len(after)} samples after the warm-up: too few to judge"
        return Level(
            start=start, end=end, max=top, early=None, late=None, allowed=None, flat=False, why=why
        )
    n = max(1, round(len(after) * _WINDOW))
    early, late = statistics.median(after[:n]), statistics.median(after[-n:])
    allowed = tol.allowed(metric, early)
    flat = late - early <= allowed
    why = "" if flat else f"grew by {late - early:g} (allowed {allowed:g})"
    return Level(
        start=start, end=end, max=top, early=early, late=late, allowed=allowed, flat=flat, why=why
    )
