"""A worker calls its authority silent after ``SILENT_AFTER`` seconds without a word, judged only by ticks of its
own that came on time, and no longer as soon as a word comes."""

from __future__ import annotations

import pytest

from gateway.workers.liveness import CODE, SILENT_AFTER, WATCH_EVERY, Liveness


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.heard = 100.0

    def advance(self, seconds: float) -> None:
        self.now += seconds


def ticking(clock: Clock, liveness: Liveness, seconds: float) -> None:
    """``seconds`` of the worker's timer, every tick on time."""
    for _ in range(round(seconds / WATCH_EVERY)):
        clock.advance(WATCH_EVERY)
        liveness.tick()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def liveness(clock: Clock) -> Liveness:
    watch = Liveness(lambda: clock.heard, lambda: clock.now)
    watch.tick()
    return watch


def test_an_authority_that_says_nothing_past_the_limit_is_silent(clock: Clock, liveness: Liveness) -> None:
    ticking(clock, liveness, SILENT_AFTER)
    assert not liveness.silent
    ticking(clock, liveness, WATCH_EVERY * 2)
    assert liveness.silent and liveness.silent_since == clock.heard
    refusal = liveness.refusal()
    assert refusal.code == CODE and refusal.retry_after == SILENT_AFTER and "has not answered for" in refusal.message


def test_an_authority_heard_from_in_time_is_never_silent(clock: Clock, liveness: Liveness) -> None:
    for _ in range(20):
        ticking(clock, liveness, SILENT_AFTER / 2)
        clock.heard = clock.now
    assert not liveness.silent


def test_the_workers_own_stall_is_not_taken_for_the_authoritys_silence(clock: Clock, liveness: Liveness) -> None:
    clock.advance(SILENT_AFTER * 3)  # this worker's loop was held: its timer and the authority's words both late
    liveness.tick()
    assert not liveness.silent
    clock.heard = clock.now  # read in the same loop turn as the late tick
    ticking(clock, liveness, WATCH_EVERY * 2)
    assert not liveness.silent


def test_a_word_from_the_authority_ends_the_silence(clock: Clock, liveness: Liveness) -> None:
    ticking(clock, liveness, SILENT_AFTER + 1)
    assert liveness.silent
    clock.heard = clock.now
    liveness.heard()
    assert not liveness.silent


def test_the_silence_is_told_once_as_it_begins(clock: Clock) -> None:
    told: list[float] = []
    liveness = Liveness(lambda: clock.heard, lambda: clock.now, lambda: told.append(clock.now))
    liveness.tick()
    ticking(clock, liveness, SILENT_AFTER + 2 * WATCH_EVERY)
    ticking(clock, liveness, 2.0)
    assert len(told) == 1 and liveness.silent
