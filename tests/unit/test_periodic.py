"""The one helper every background loop runs on: when it runs, how it stops, what it does with a failure."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.periodic import Periodic
from tests.support.clock import ManualSleep

LOG = logging.getLogger("gateway.periodic")


class Calls:
    """A run that counts its calls and raises while ``failing``."""

    def __init__(self) -> None:
        self.count = 0
        self.failing = False

    def __call__(self) -> None:
        self.count += 1
        if self.failing:
            raise RuntimeError("boom")


def periodic(
    run: Calls, sleep: ManualSleep, *, immediately: bool = True, stop_on_error: bool = False,
    logger: logging.Logger = LOG,
) -> Periodic:
    return Periodic(
        run, 2.0, name="test-loop", failed="the test loop failed", immediately=immediately,
        stop_on_error=stop_on_error, logger=logger, sleep=sleep,
    )


@pytest.mark.parametrize(("immediately", "first_runs"), [(True, 1), (False, 0)])
async def test_the_first_run_comes_at_once_or_after_one_interval(immediately: bool, first_runs: int) -> None:
    run, sleep = Calls(), ManualSleep()
    loop = periodic(run, sleep, immediately=immediately)
    loop.start()
    await asyncio.sleep(0)
    assert run.count == first_runs
    await sleep.wake_and_run()
    await sleep.wake_and_run()
    assert run.count == first_runs + 2
    assert sleep.delays == [2.0, 2.0, 2.0]
    await loop.stop()


async def test_an_async_run_is_awaited_before_the_sleep() -> None:
    sleep, entered, release = ManualSleep(), asyncio.Event(), asyncio.Event()

    async def run() -> None:
        entered.set()
        await release.wait()

    loop = Periodic(run, 1.0, name="test-loop", failed="failed", sleep=sleep)
    loop.start()
    await entered.wait()
    assert sleep.delays == []
    release.set()
    await asyncio.sleep(0)
    assert sleep.delays == [1.0]
    await loop.stop()


async def test_an_interval_given_as_a_function_is_read_before_each_sleep() -> None:
    sleep, paces = ManualSleep(), iter([0.5, 1.5, 3.0])
    loop = Periodic(lambda: None, lambda: next(paces), name="test-loop", failed="failed", sleep=sleep)
    loop.start()
    await asyncio.sleep(0)
    await sleep.wake_and_run()
    await sleep.wake_and_run()
    assert sleep.delays == [0.5, 1.5, 3.0]
    await loop.stop()


@pytest.mark.parametrize(("drawn", "delay"), [(-0.1, 9.0), (0.0, 10.0), (0.1, 11.0)])
async def test_jitter_spreads_each_sleep_around_the_interval(drawn: float, delay: float) -> None:
    asked: list[tuple[float, float]] = []

    def uniform(low: float, high: float) -> float:
        asked.append((low, high))
        return drawn

    loop = Periodic(lambda: None, 10.0, name="test-loop", failed="failed", jitter=0.1, uniform=uniform)
    assert loop.interval() == pytest.approx(delay)
    assert asked == [(-0.1, 0.1)]


@pytest.mark.parametrize("jitter", [-0.1, 1.0, 2.0])
def test_a_jitter_outside_a_fraction_of_the_interval_is_refused(jitter: float) -> None:
    with pytest.raises(ValueError, match="jitter"):
        Periodic(lambda: None, 1.0, name="test-loop", failed="failed", jitter=jitter)


async def test_a_failing_run_is_logged_once_per_streak_and_the_loop_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    run, sleep = Calls(), ManualSleep()
    run.failing = True
    loop = periodic(run, sleep)
    with caplog.at_level(logging.DEBUG, logger="gateway.periodic"):
        loop.start()
        await asyncio.sleep(0)
        for _ in range(3):
            await sleep.wake_and_run()
        run.failing = False
        await sleep.wake_and_run()
        await sleep.wake_and_run()
    assert run.count == 6 and loop.running and loop.failures == 0
    levels = [(r.levelname, r.exc_info is not None) for r in caplog.records]
    assert levels == [("ERROR", True), ("DEBUG", True), ("DEBUG", True), ("DEBUG", True), ("WARNING", False)]
    assert "the test loop failed 4 times in a row; it works again" in caplog.records[-1].getMessage()
    await loop.stop()


async def test_a_second_streak_is_logged_again(caplog: pytest.LogCaptureFixture) -> None:
    run, sleep = Calls(), ManualSleep()
    loop = periodic(run, sleep)
    loop.start()
    for failing in (True, False, True):
        run.failing = failing
        await sleep.wake_and_run()
    assert [r.levelname for r in caplog.records if r.levelno >= logging.WARNING] == ["ERROR", "WARNING", "ERROR"]
    await loop.stop()


async def test_a_loop_told_to_stop_on_error_ends_at_its_first_failure(caplog: pytest.LogCaptureFixture) -> None:
    run, sleep = Calls(), ManualSleep()
    run.failing = True
    loop = periodic(run, sleep, stop_on_error=True)
    loop.start()
    for _ in range(3):
        await asyncio.sleep(0)
    assert run.count == 1 and not loop.running and sleep.delays == []
    assert "the test loop failed; the loop stops" in caplog.text
    await loop.stop()


async def test_the_owner_s_logger_names_the_failure() -> None:
    run, sleep, records = Calls(), ManualSleep(), list[logging.LogRecord]()
    run.failing = True
    owner = logging.getLogger("gateway.some.owner")

    class Kept(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Kept()
    owner.addHandler(handler)
    try:
        loop = periodic(run, sleep, logger=owner)
        loop.start()
        await asyncio.sleep(0)
        await loop.stop()
    finally:
        owner.removeHandler(handler)
    assert [r.name for r in records] == ["gateway.some.owner"]


async def test_stop_ends_the_task_is_idempotent_and_a_stopped_loop_starts_again() -> None:
    run, sleep = Calls(), ManualSleep()
    loop = periodic(run, sleep)
    await loop.stop()  # never started: nothing to do
    loop.start()
    loop.start()  # already running: the same task goes on
    await asyncio.sleep(0)
    assert run.count == 1 and loop.running
    await loop.stop()
    await loop.stop()
    assert not loop.running
    loop.start()
    await asyncio.sleep(0)
    assert run.count == 2 and loop.running
    await loop.stop()


async def test_a_run_may_stop_its_own_loop() -> None:
    sleep, runs = ManualSleep(), list[int]()
    loop: Periodic

    async def run() -> None:
        runs.append(1)
        await loop.stop()

    loop = Periodic(run, 1.0, name="test-loop", failed="failed", sleep=sleep)
    loop.start()
    for _ in range(3):
        await asyncio.sleep(0)
    assert runs == [1] and not loop.running and sleep.delays == []


async def test_a_stop_cancelled_from_outside_stays_cancelled() -> None:
    sleep, unwinding, release = ManualSleep(), asyncio.Event(), asyncio.Event()

    async def run() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            unwinding.set()
            await release.wait()  # a slow clean-up: the stop waits for it

    loop = Periodic(run, 1.0, name="test-loop", failed="failed", sleep=sleep)
    loop.start()
    await asyncio.sleep(0)
    stopping = asyncio.create_task(loop.stop())
    await unwinding.wait()
    stopping.cancel()
    await asyncio.sleep(0)
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await stopping
    assert stopping.cancelled()
