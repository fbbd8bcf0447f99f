"""Rolling restarts (``RollingRestarts``) over engines that restart when told: one at a time, in order, a ready
engine only while another is ready (else skipped after the wait), on a schedule, and a request during a turn
joins it."""

from __future__ import annotations

import asyncio

import pytest

from gateway.managed.lifecycle import EngineLifecycle
from gateway.managed.rolling import READY_POLL, RollingRestarts
from tests.support.clock import FakeClock, ManualSleep

READY = EngineLifecycle.READY


class Engine:
    """Restarts when told, and comes back ready when the test says so; ``log`` is shared by all engines."""

    def __init__(self, name: str, log: list[str], state: EngineLifecycle = READY) -> None:
        self.name = name
        self.state = state
        self.log = log
        self.back = asyncio.Event()

    async def restart(self, reason: str, *, detail: str | None = None) -> None:
        self.log.append(f"{self.name} down ({reason})")
        self.state = EngineLifecycle.RESTARTING
        await self.back.wait()
        self.back.clear()
        self.state = READY
        self.log.append(f"{self.name} ready")


class Rig:
    def __init__(self, *states: EngineLifecycle, every: float | None = None) -> None:
        self.log: list[str] = []
        self.engines = [Engine(str(i), self.log, s) for i, s in enumerate(states)]
        self.clock = FakeClock()
        self.sleep = ManualSleep()
        self.rolling = RollingRestarts(self.engines, every=every, ready_timeout=60.0, clock=self.clock,
                                       sleep=self.sleep)

    async def bring_back(self, name: str) -> None:
        self.engines[int(name)].back.set()
        for _ in range(5):
            await asyncio.sleep(0)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_every_engine_restarts_in_turn_never_two_at_once() -> None:
    rig = Rig(READY, READY, READY)
    names, started = rig.rolling.request()
    assert (names, started) == (["0", "1", "2"], True)
    await settle()
    assert rig.log == ["0 down (manual)"] and rig.rolling.status()["restarting"] == "0"
    for name in ("0", "1", "2"):
        await rig.bring_back(name)
    await rig.rolling.wait()
    assert rig.log == ["0 down (manual)", "0 ready", "1 down (manual)", "1 ready", "2 down (manual)", "2 ready"]
    status = rig.rolling.status()
    assert (status["rounds"], status["in_progress"], status["last"]["restarted"]) == (1, False, ["0", "1", "2"])


async def test_a_request_during_a_turn_joins_it() -> None:
    rig = Rig(READY, READY)
    rig.rolling.request(["1"])
    await settle()
    assert rig.rolling.request() == (["1"], False)
    await rig.bring_back("1")
    await rig.rolling.wait()
    assert rig.log == ["1 down (manual)", "1 ready"]


async def test_a_ready_engine_waits_until_another_is_ready() -> None:
    rig = Rig(READY, EngineLifecycle.RESTARTING)  # engine 1 is being restarted by its own supervisor
    rig.rolling.request(["0"])
    await settle()
    assert rig.log == [] and rig.sleep.delays == [READY_POLL]
    rig.engines[1].state = READY
    await rig.sleep.wake_and_run()
    assert rig.log == ["0 down (manual)"]
    await rig.bring_back("0")
    await rig.rolling.wait()


async def test_a_ready_engine_is_skipped_when_no_other_is_ready_within_the_wait() -> None:
    rig = Rig(READY, EngineLifecycle.DOWN)
    rig.rolling.request(["0"], "scheduled")
    await settle()
    rig.clock.now += 61.0
    await rig.sleep.wake_and_run()
    await rig.rolling.wait()
    assert rig.log == [] and rig.rolling.status()["last"]["skipped"] == {
        "0": "no other engine was ready within 60 s"
    }


@pytest.mark.parametrize(
    ("states", "first"),
    [((READY,), "0 down (manual)"), ((EngineLifecycle.DOWN, EngineLifecycle.DOWN), "0 down (manual)")],
    ids=["one engine", "an engine already down"],
)
async def test_an_engine_alone_or_already_down_restarts_without_waiting(
    states: tuple[EngineLifecycle, ...], first: str
) -> None:
    rig = Rig(*states)
    rig.rolling.request(["0"])
    await settle()
    assert rig.log == [first]
    await rig.bring_back("0")
    await rig.rolling.wait()


async def test_the_schedule_rolls_every_engine_each_period() -> None:
    rig = Rig(READY, READY, every=3600.0)
    rig.rolling.start()
    await settle()
    assert rig.sleep.delays == [3600.0] and rig.rolling.status()["next_in_seconds"] == 3600.0
    await rig.sleep.wake_and_run()
    assert rig.log == ["0 down (scheduled)"]
    await rig.bring_back("0")
    await rig.bring_back("1")
    assert rig.log[-1] == "1 ready" and rig.rolling.status()["rounds"] == 1
    await settle()
    assert rig.sleep.delays == [3600.0, 3600.0]  # the next period began when the turn ended
    await rig.rolling.close()


async def test_closing_ends_a_turn_under_way() -> None:
    rig = Rig(READY, READY)
    rig.rolling.request()
    await settle()
    await rig.rolling.close()
    assert rig.rolling.status()["in_progress"] is False and rig.rolling.status()["last"]["restarted"] == []
