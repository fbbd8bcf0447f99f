from __future__ import annotations

import asyncio

import pytest

from gateway.engine.live import EngineSnapshot, EngineView, counter_increase
from gateway.engine.vllm_api import RankMetrics
from gateway.metrics import Metrics
from tests.support.paths import FIXTURES

V1_TEXT = (FIXTURES / "vllm" / "v1-0.32.0" / "metrics.txt").read_text()
DISABLED_TEXT = (FIXTURES / "vllm" / "v1-0.32.0-disable-log-stats" / "metrics.txt").read_text()


@pytest.mark.parametrize(
    ("previous", "current", "increase"),
    [(None, 5.0, 0.0), (5.0, None, 0.0), (5.0, 5.0, 0.0), (5.0, 8.0, 3.0), (9.0, 2.0, 2.0)],
    ids=["first-reading", "missing", "unchanged", "grew", "engine-restarted"],
)
def test_counter_increase(previous: float | None, current: float | None, increase: float) -> None:
    assert counter_increase(previous, current) == increase


# -- the view -------------------------------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeUpstream:
    """Answers GETs like vLLM; ``down`` makes every call raise like a refused connection."""

    def __init__(self, metrics_text: str = V1_TEXT) -> None:
        self.metrics_text = metrics_text
        self.metrics_status = 200
        self.down = False
        self.calls: list[str] = []

    async def __call__(self, path: str) -> tuple[int, bytes]:
        self.calls.append(path)
        if self.down:
            raise ConnectionRefusedError("connect refused")
        if path == "/metrics":
            return self.metrics_status, self.metrics_text.encode()
        return 404, b"{}"


def make_view(upstream: FakeUpstream, clock: FakeClock, metrics: Metrics | None = None) -> EngineView:
    return EngineView(upstream, interval=0.25, stale_after=2.0, metrics=metrics or Metrics(), clock=clock)


def sample(metrics: Metrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(name)


async def test_refresh_builds_a_snapshot_from_metrics() -> None:
    clock = FakeClock()
    view = make_view(FakeUpstream(), clock)
    assert not view.snapshot.ok and view.is_stale()
    snap = await view.refresh()
    assert snap == EngineSnapshot(
        taken_at=100.0, ok=True, has_metrics=True, kv_usage=0.25, running=3, waiting=1, preemptions_total=9.0,
        generation_tokens_total=6789.0, num_gpu_blocks=32, block_size=128, prefix_caching=True,
        prefix_cache_queries_total=5200.0, prefix_cache_hits_total=1280.0, prompt_tokens_total=12345.0,
        ranks={"0": RankMetrics(kv_usage=0.25, running=3, waiting=1, preemptions_total=9.0,
                                generation_tokens_total=6789.0, num_gpu_blocks=32)},
    )
    assert view.snapshot is snap and not view.is_stale()


async def test_the_view_scrapes_only_metrics_the_models_have_their_registry() -> None:
    upstream = FakeUpstream()
    view = make_view(upstream, FakeClock())
    await view.refresh()
    upstream.down = True
    await view.refresh()
    upstream.down = False
    await view.refresh()
    assert upstream.calls == ["/metrics"] * 3


@pytest.mark.parametrize("failure", ["transport", "http-500"])
async def test_a_failed_scrape_keeps_static_facts_and_drops_live_ones(failure: str) -> None:
    upstream = FakeUpstream()
    metrics = Metrics()
    view = make_view(upstream, FakeClock(), metrics)
    await view.refresh()
    if failure == "transport":
        upstream.down = True
    else:
        upstream.metrics_status = 500
    snap = await view.refresh()
    assert not snap.ok and not snap.has_metrics
    assert (snap.kv_usage, snap.running, snap.preemptions_total) == (None, None, None)
    assert (snap.num_gpu_blocks, snap.block_size) == (32, 128)
    assert sample(metrics, "vllm_guard_engine_scrape_errors_total") == 1.0


async def test_disable_log_stats_gives_an_ok_snapshot_without_metrics() -> None:
    view = make_view(FakeUpstream(DISABLED_TEXT), FakeClock())
    snap = await view.refresh()
    assert snap.ok and not snap.has_metrics
    assert (snap.kv_usage, snap.num_gpu_blocks, snap.running) == (None, None, None)


async def test_metrics_turn_stale_when_scrapes_stop_succeeding() -> None:
    clock = FakeClock()
    upstream = FakeUpstream()
    metrics = Metrics()
    view = make_view(upstream, clock, metrics)
    await view.refresh()
    upstream.down = True
    clock.now += 1.5
    await view.refresh()
    assert not view.is_stale() and view.age() == 1.5
    clock.now += 1.0
    await view.refresh()
    assert view.is_stale()
    assert sample(metrics, "vllm_guard_engine_metrics_stale") == 1.0
    assert sample(metrics, "vllm_guard_engine_metrics_age_seconds") == 2.5


async def test_listeners_get_old_and_new_and_a_failing_one_harms_nobody() -> None:
    view = make_view(FakeUpstream(), FakeClock())
    seen: list[tuple[bool, bool]] = []

    def broken(old: EngineSnapshot, new: EngineSnapshot) -> None:
        raise RuntimeError("listener bug")

    view.on_snapshot(broken)
    view.on_snapshot(lambda old, new: seen.append((old.ok, new.ok)))
    await view.refresh()
    await view.refresh()
    assert seen == [(False, True), (True, True)]


async def test_preemptions_are_counted_as_increases_across_outages_and_restarts() -> None:
    upstream = FakeUpstream()
    metrics = Metrics()
    view = make_view(upstream, FakeClock(), metrics)
    for total, down in [(9, False), (12, False), (0, True), (15, False), (2, False)]:
        upstream.down = down
        upstream.metrics_text = V1_TEXT.replace("num_preemptions_total{engine=\"0\",model_name=\"tiny\"} 9.0",
                                                f"num_preemptions_total{{engine=\"0\",model_name=\"tiny\"}} {total}")
        await view.refresh()
    # 9 is the baseline; then +3, +3 seen after the outage, +2 after the engine restarted from zero.
    assert sample(metrics, "vllm_guard_engine_preemptions_total") == 8.0


class ManualSleep:
    """An injectable sleep that returns only when the test says so."""

    def __init__(self) -> None:
        self.waiting: list[asyncio.Future[None]] = []
        self.delays: list[float] = []
        self.called = asyncio.Event()

    async def __call__(self, delay: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        self.delays.append(delay)
        self.called.set()
        await fut

    async def wake(self) -> None:
        self.called.clear()
        for fut in self.waiting:
            if not fut.done():
                fut.set_result(None)
        self.waiting.clear()
        await self.called.wait()


async def test_the_timer_scrapes_every_interval_and_survives_errors() -> None:
    upstream = FakeUpstream()
    sleep = ManualSleep()
    view = EngineView(upstream, interval=0.25, stale_after=2.0, metrics=Metrics(), clock=FakeClock(), sleep=sleep)
    real_refresh = view.refresh
    crashes = 0

    async def crash_once() -> EngineSnapshot:
        nonlocal crashes
        if crashes == 0:
            crashes += 1
            raise RuntimeError("bug")
        return await real_refresh()

    view.refresh = crash_once  # type: ignore[method-assign]
    await view.start()
    await sleep.called.wait()
    assert crashes == 1 and upstream.calls == []
    await sleep.wake()
    await sleep.wake()
    assert upstream.calls.count("/metrics") == 2
    assert sleep.delays == [0.25, 0.25, 0.25]
    await view.stop()
    await view.stop()
