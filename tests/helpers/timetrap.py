"""A per-test watchdog (OTP's suites use a one-minute timetrap): a hang fails its test instead
of stalling the whole run."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import pytest

TIMETRAP_S = 90
SLOW_TIMETRAP_S = 400  # tests marked slow (100k children on a busy machine)


class Timetrap(Exception):
    """The test ran past its timetrap (a hang)."""


@contextmanager
def timetrap(seconds: int) -> Iterator[None]:
    """Raise :class:`Timetrap` in the main thread if the block runs past ``seconds``."""

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        raise Timetrap(f"test still running after {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(autouse=True)
def _timetrap(request: pytest.FixtureRequest) -> Iterator[None]:
    with timetrap(SLOW_TIMETRAP_S if request.node.get_closest_marker("slow") else TIMETRAP_S):
        yield
