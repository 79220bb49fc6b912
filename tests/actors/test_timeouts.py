"""The deadline sweep: long timeouts go to the coarse sweep, the rest stay on the fine one."""

from __future__ import annotations

from actors._timeouts import LONG_TIMEOUT, Deadlines


class _Reply:
    def __init__(self) -> None:
        self.done = False
        self.expired = False

    def expire(self) -> None:
        self.expired = self.done = True


def test_long_timeouts_go_to_the_coarse_sweep() -> None:
    now = [0.0]
    armed: list[str] = []
    coarse = Deadlines(lambda: now[0], lambda: armed.append("coarse"))
    fine = Deadlines(lambda: now[0], lambda: armed.append("fine"), coarse)
    short, long = _Reply(), _Reply()
    fine.add(1.0, short)
    fine.add(LONG_TIMEOUT, long)
    assert armed == ["fine", "coarse"]  # each sweep armed once, by its own timeout
    assert fine.sweep() and coarse.sweep()  # both filed, neither due
    now[0] = 1.0
    assert not fine.sweep()  # the fine sweep is done: it never had the long one
    assert short.expired and not long.expired
    now[0] = LONG_TIMEOUT
    assert not coarse.sweep()
    assert long.expired


def test_answered_long_timeouts_are_dropped() -> None:
    coarse = Deadlines(lambda: 0.0, lambda: None)
    fine = Deadlines(lambda: 0.0, lambda: None, coarse)
    reply = _Reply()
    fine.add(LONG_TIMEOUT * 3, reply)
    reply.done = True  # answered before the sweep
    assert not coarse.sweep()
    assert not reply.expired


def test_a_deadline_filed_while_sweeping_keeps_the_sweep_going() -> None:
    # A stream's watch files itself again from its expire(), during the sweep.
    now = [0.0]
    armed: list[str] = []
    sweep = Deadlines(lambda: now[0], lambda: armed.append("armed"))
    later = _Reply()

    class FilesAgain(_Reply):
        def expire(self) -> None:
            super().expire()
            sweep.add(1.0, later)

    sweep.add(1.0, FilesAgain())
    assert sweep.sweep()
    now[0] = 1.0
    assert sweep.sweep()  # nothing filed is left, but `later` was noted meanwhile
    assert sweep.armed and armed == ["armed"]
    now[0] = 2.0
    assert sweep.sweep() and not later.expired
    now[0] = 3.0
    assert not sweep.sweep()
    assert later.expired
