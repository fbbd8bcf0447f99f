"""The event loop's lag: how much later than asked its timer woke, recorded by one owned task."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.metrics import Metrics
from gateway.observe.loop_lag import LoopLag


class ScriptedLoop:
    """A clock that each sleep moves on by the interval plus the next scripted lag; the last wakes the test."""

    def __init__(self, lags: list[float]) -> None:
        self.now = 100.0
        self.lags = list(lags)
        self.recorded: list[float] = []
        self.done = asyncio.Event()

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        if not self.lags:
            self.done.set()
            await asyncio.Event().wait()  # parked until the monitor is stopped
        self.now += seconds + self.lags.pop(0)


@pytest.mark.parametrize(
    ("lags", "expected"),
    [
        ([0.0, 0.0], [0.0, 0.0]),
        ([0.0, 2.5, 0.01], [0.0, 2.5, 0.01]),
    ],
    ids=["an idle loop lags nothing", "a stall is recorded whole"],
)
async def test_each_wake_up_records_how_late_it_came(lags: list[float], expected: list[float]) -> None:
    loop = ScriptedLoop(lags)
    lag = LoopLag(loop.recorded.append, interval=0.1, clock=loop.clock, sleep=loop.sleep)
    await lag.start()
    await asyncio.wait_for(loop.done.wait(), 5)
    await lag.stop()
    assert loop.recorded == pytest.approx(expected)


async def test_a_timer_woken_early_records_no_negative_lag() -> None:
    loop = ScriptedLoop([-0.05])
    lag = LoopLag(loop.recorded.append, interval=0.1, clock=loop.clock, sleep=loop.sleep)
    await lag.start()
    await asyncio.wait_for(loop.done.wait(), 5)
    await lag.stop()
    assert loop.recorded == [0.0]


async def test_a_call_that_blocks_the_loop_shows_in_the_metric() -> None:
    metrics = Metrics()
    seen = asyncio.Event()
    readings: list[float] = []

    def record(seconds: float) -> None:
        metrics.record_loop_lag(seconds)
        readings.append(seconds)
        if seconds >= 0.25:
            seen.set()

    lag = LoopLag(record, interval=0.01)
    await lag.start()
    await asyncio.sleep(0)  # the monitor's first sleep is under way
    time.sleep(0.3)  # noqa: ASYNC251  # the stall itself: a blocking call on the loop
    await asyncio.wait_for(seen.wait(), 5)
    await lag.stop()
    assert max(readings) >= 0.25
    body = metrics.render()[0].decode()
    assert 'vllm_guard_event_loop_lag_seconds_bucket{le="0.25"}' in body
    assert metrics.registry.get_sample_value("vllm_guard_event_loop_lag_seconds_count") == len(readings)


async def test_stopping_ends_the_task_and_is_idempotent() -> None:
    lag = LoopLag(lambda s: None, interval=0.01)
    await lag.start()
    assert lag._timer.running
    await lag.stop()
    await lag.stop()
    assert not lag._timer.running
