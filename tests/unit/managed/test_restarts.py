"""Restarts are limited within a sliding window and backed off exponentially, up to a bound."""

from __future__ import annotations

from gateway.managed.restarts import BACKOFF_MAX, RestartBudget


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def budget(clock: Clock, max_restarts: int = 3) -> RestartBudget:
    return RestartBudget(max_restarts=max_restarts, window=60.0, backoff_base=1.0, clock=clock)


def test_the_first_restart_waits_nothing_then_the_wait_doubles() -> None:
    b = budget(Clock(), max_restarts=100)
    delays = []
    for _ in range(4):
        delays.append(b.delay())
        b.record()
    assert delays == [0.0, 1.0, 2.0, 4.0]


def test_the_back_off_is_bounded() -> None:
    b = budget(Clock(), max_restarts=100)
    for _ in range(20):
        b.record()
    assert b.delay() == BACKOFF_MAX


def test_too_many_restarts_within_the_window_exhaust_it_until_they_age_out() -> None:
    clock = Clock()
    b = budget(clock, max_restarts=2)
    assert b.exhausted() is None
    b.record()
    clock.now = 10.0
    b.record()
    assert b.exhausted() == "2 restarts within 60 s (limit 2); giving up"
    clock.now = 60.0  # the first one is a window old
    assert b.exhausted() is None
    assert b.delay() == 1.0


def test_clearing_forgets_past_restarts() -> None:
    b = budget(Clock(), max_restarts=1)
    b.record()
    assert b.exhausted() is not None
    b.clear()
    assert b.exhausted() is None
    assert b.delay() == 0.0
