"""The mean wait in the engine's own queue, from its snapshots' waiting counts and the first tokens (Little's law)."""

from __future__ import annotations

import pytest

from gateway.admission.engine_wait import MIN_DEPARTURES, WINDOW_SECONDS, EngineQueueWait


def run(waiting: list[int], departures_per_s: float, seconds: float = WINDOW_SECONDS, interval: float = 0.25,
        engines: int = 1) -> float | None:
    """Snapshots every ``interval`` showing ``waiting`` (cycled) in each engine, first tokens at a steady rate."""
    wait = EngineQueueWait()
    steps = round(seconds / interval)
    gap = 1.0 / departures_per_s if departures_per_s else None
    next_departure = 0.0
    for i in range(steps + 1):
        now = i * interval
        for engine in range(engines):
            wait.snapshot(now, engine, waiting[i % len(waiting)])
        while gap is not None and next_departure <= now:
            wait.departed(next_departure)
            next_departure += gap
    return wait.seconds(steps * interval)


@pytest.mark.parametrize(("waiting", "rate", "engines", "seconds"), [
    pytest.param([10], 4.0, 1, 2.5, id="10 waiting, 4 leaving a second: 2.5 s each"),
    pytest.param([0], 4.0, 1, 0.0, id="nothing ever waiting: no wait"),
    pytest.param([0, 0, 0, 4], 8.0, 1, 0.125, id="4 waiting a quarter of the time, 8 leaving a second: an eighth"),
    pytest.param([5], 4.0, 2, 2.5, id="two engines, 5 waiting in each, 4 leaving a second in all"),
    pytest.param([10], 1.0, 1, None, id="fewer first tokens in the window than it takes to say"),
])
def test_the_mean_wait_is_the_mean_count_waiting_over_the_rate_they_leave(
    waiting: list[int], rate: float, engines: int, seconds: float | None
) -> None:
    got = run(waiting, rate, engines=engines)
    assert got == (None if seconds is None else pytest.approx(seconds, rel=0.15))


def test_only_the_last_window_counts() -> None:
    wait = EngineQueueWait()
    for i in range(41):  # 10 s of snapshots: 20 waiting in the first five, none after
        wait.snapshot(i * 0.25, 0, 20 if i < 20 else 0)
        wait.departed(i * 0.25)
    assert wait.seconds(10.0) == pytest.approx(0.0)


def test_a_count_holds_until_the_next_snapshot() -> None:
    # One snapshot of 6 waiting, then none for 4 s: 6 held over the whole window, 2 leaving a second.
    wait = EngineQueueWait()
    wait.snapshot(0.0, 0, 6)
    for i in range(MIN_DEPARTURES + 2):
        wait.departed(i * 0.5)
    assert wait.seconds(5.0) == pytest.approx(6 / 2.0, rel=0.1)


@pytest.mark.parametrize(("waiting", "rate", "ahead"), [
    pytest.param(8, 4.0, 2.0, id="8 waiting now, 4 leaving a second: 2 s ahead of a request admitted now"),
    pytest.param(0, 4.0, 0.0, id="none waiting: nothing ahead"),
    pytest.param(8, 1.0, 0.0, id="too few left lately to say: nothing assumed"),
])
def test_the_wait_ahead_is_those_waiting_now_over_the_rate_they_leave(waiting: int, rate: float, ahead: float) -> None:
    wait = EngineQueueWait()
    for i in range(21):
        now = i * 0.25
        wait.snapshot(now, 0, waiting)
        if i % round(1 / (rate * 0.25)) == 0:
            wait.departed(now)
    assert wait.ahead(5.0) == pytest.approx(ahead, rel=0.15)
