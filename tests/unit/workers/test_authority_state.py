"""The authority tells its workers the engines' state as soon as something that makes it changes: a scrape, a
hang declared or over, a health verdict that flips, a managed engine's lifecycle; its periodic check is only
the net for the rest. Each push is the state as it is then, sent once while it does not change."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.admission.ledger import Capacity
from gateway.config import Settings
from gateway.engine.client import Upstream
from gateway.engine.engine import Engine
from gateway.engine.health import EngineHealth
from gateway.engine.live import EngineView
from gateway.engine.progress import ProgressDetector
from gateway.guard.models import Models
from gateway.managed.lifecycle import EngineLifecycle, Phase
from gateway.metrics import Metrics
from gateway.workers.authority import Authority
from gateway.workers.messages import State
from tests.support.clock import FakeClock
from tests.unit.workers.transport import Transport

URL = "http://engine-0:8000"
PAGE = b'vllm:cache_config_info{block_size="16",num_gpu_blocks="512"} 1.0\nvllm:num_requests_running 0.0\n'


class World:
    """One engine (a real ``Engine``: its view, hang detector and health) and one supervisor, behind an authority
    with one worker connected; nothing fetched over a network."""

    def __init__(self, tmp: Path) -> None:
        self.clock = FakeClock()
        self.health_status = 200
        settings = Settings.model_validate({"upstream": [URL]})
        client = Upstream(settings, base_url=lambda: URL)
        view = EngineView(self._metrics_page, interval=60.0, stale_after=120.0, metrics=Metrics())
        self.engine = Engine(client, Models(settings, client, Metrics()), view)
        self.engine.progress = ProgressDetector(10.0, clock=self.clock)
        self.engine.health = EngineHealth(self._health)
        self.capacity = Capacity(512, 16, "engine")
        self.supervisor = SimpleNamespace(state="starting", retry_after=lambda: 5.0, url=URL, told=None)
        self.supervisor.on_change = self._watched
        admission = SimpleNamespace(largest_capacity=lambda: self.capacity, sharing=False)
        parts = SimpleNamespace(every_engine=lambda: [self.engine], every_supervisor=lambda: [self.supervisor],
                                local_admission=lambda: admission)
        self.authority = Authority(parts, tmp / "authority.sock")  # type: ignore[arg-type]
        self.wire = Transport()

    def _watched(self, callback: Callable[[], None]) -> None:
        self.supervisor.told = callback

    async def _metrics_page(self, path: str) -> tuple[int, bytes]:
        return 200, PAGE

    async def _health(self, path: str) -> tuple[int, bytes]:
        return self.health_status, b""

    async def start(self) -> None:
        await self.authority.start()
        self.authority._connect().connection_made(self.wire)  # type: ignore[arg-type]

    async def told(self) -> list[State]:
        """The states sent since the last look: the channel writes what was sent in a loop iteration at its end."""
        await asyncio.sleep(0)
        return [m for m in self.wire.sent() if isinstance(m, State)]


@pytest.fixture
async def world(tmp_path: Path) -> Any:
    world = World(tmp_path)
    await world.start()
    for _ in range(5):  # the periodic check's first run, at once: the state a worker is told first
        await asyncio.sleep(0)
    assert len(await world.told()) == 1
    yield world
    await world.authority.close()


async def test_a_scrape_that_changes_the_capacity_is_told_at_once(world: World) -> None:
    world.capacity = Capacity(1024, 16, "engine")
    await world.engine.view.refresh()
    assert [s.capacity for s in await world.told()] == [Capacity(1024, 16, "engine")]
    await world.engine.view.refresh()
    assert await world.told() == [], "a scrape that changes nothing sends nothing"


async def test_a_hang_declared_and_over_is_told_at_once(world: World) -> None:
    progress = world.engine.progress
    progress.in_flight = 1
    progress.tick()
    world.clock.now += 60.0
    progress.tick()
    assert progress.hung
    [state] = await world.told()
    assert state.engines[0].hung and state.engines[0].refusal is not None
    progress.answers += 1  # it moved again
    progress.tick()
    [state] = await world.told()
    assert not state.engines[0].hung and state.engines[0].refusal is None


async def test_a_health_verdict_that_flips_is_told_at_once(world: World) -> None:
    world.health_status = 503
    await world.engine.health.check()
    [state] = await world.told()
    assert state.engines[0].refusal is not None and "HTTP 503" in state.engines[0].refusal.fields["message"]
    await world.engine.health.check()
    assert await world.told() == [], "the same verdict again sends nothing"


async def test_a_managed_engines_lifecycle_is_told_at_once(world: World) -> None:
    assert world.supervisor.told is not None
    world.supervisor.state = "ready"
    world.supervisor.told()
    assert [s.supervisors[0].state for s in await world.told()] == ["ready"]


@pytest.mark.parametrize("states", [[EngineLifecycle.READY], [EngineLifecycle.DRAINING, EngineLifecycle.RESTARTING]])
def test_a_phase_calls_its_watcher_on_every_set(states: list[EngineLifecycle]) -> None:
    phase = Phase(None, FakeClock())
    seen: list[EngineLifecycle] = []
    phase.on_change = lambda: seen.append(phase.state)
    for state in states:
        phase.set(state)
    assert seen == states
