from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from gateway.engine.live import (
    EngineSnapshot,
    EngineView,
    counter_increase,
    parse_models,
    parse_vllm_metrics,
)
from gateway.metrics import Metrics

V1_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:num_preemptions_total{engine="0",model_name="tiny"} 9.0
vllm:num_preemptions_created{engine="0",model_name="tiny"} 1.7630000e+09
vllm:generation_tokens_total{engine="0",model_name="tiny"} 1234.0
vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",engine="0",\
gpu_memory_utilization="0.9",kv_cache_size_tokens="4096",num_cpu_blocks="None",num_gpu_blocks="32",\
num_gpu_blocks_override="None"} 1.0
python_gc_objects_collected_total{generation="0"} 123.0
"""

V0_TEXT = """\
vllm:cache_config_info{block_size="16",cache_dtype="auto",gpu_memory_utilization="0.9",num_cpu_blocks="2048",\
num_gpu_blocks="2000",sliding_window="None",swap_space_bytes="4294967296"} 1.0
vllm:num_requests_running{model_name="m"} 2.0
vllm:num_requests_swapped{model_name="m"} 0.0
vllm:num_requests_waiting{model_name="m"} 0.0
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
vllm:num_preemptions_total{model_name="m"} 0.0
vllm:generation_tokens_total{model_name="m"} 10.0
"""

DISABLED_TEXT = """\
# HELP python_gc_objects_collected_total Objects collected during gc
python_gc_objects_collected_total{generation="0"} 1234.0
process_resident_memory_bytes 1.2e+09
"""

TWO_ENGINES = """\
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 5.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.1
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.7
vllm:num_preemptions_total{engine="0",model_name="m"} 1.0
vllm:num_preemptions_total{engine="1",model_name="m"} 2.0
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="100"} 1.0
"""

NOTHING: dict[str, Any] = {
    "has_metrics": False, "kv_usage": None, "running": None, "waiting": None, "preemptions_total": None,
    "generation_tokens_total": None, "num_gpu_blocks": None, "block_size": None,
}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (V1_TEXT, {"has_metrics": True, "kv_usage": 0.25, "running": 3, "waiting": 1, "preemptions_total": 9.0,
                   "generation_tokens_total": 1234.0, "num_gpu_blocks": 32, "block_size": 128}),
        (V0_TEXT, {"has_metrics": True, "kv_usage": 0.5, "running": 2, "waiting": 0, "preemptions_total": 0.0,
                   "generation_tokens_total": 10.0, "num_gpu_blocks": 2000, "block_size": 16}),
        (DISABLED_TEXT, NOTHING),
        ("", NOTHING),
        ("\x00\xff garbage {{{ \n<html>502 Bad Gateway</html>\n", NOTHING),
        (TWO_ENGINES, {**NOTHING, "has_metrics": True, "kv_usage": 0.7, "running": 7, "preemptions_total": 3.0,
                       "num_gpu_blocks": 100, "block_size": 16}),
    ],
    ids=["v1", "v0", "disable-log-stats", "empty", "garbage", "two-engines"],
)
def test_parse_reads_what_admission_needs(text: str, expected: dict[str, Any]) -> None:
    assert parse_vllm_metrics(text) == expected


@pytest.mark.parametrize(
    ("line", "key", "value"),
    [
        ('vllm:kv_cache_usage_perc{engine="0"} 0.3\nvllm:gpu_cache_usage_perc{engine="0"} 0.9', "kv_usage", 0.3),
        ('vllm:kv_cache_usage_perc{engine="0"} 42', "kv_usage", 0.42),  # percent, not a fraction
        ('vllm:kv_cache_usage_perc{engine="0"} NaN', "kv_usage", None),
        ("vllm:num_requests_running 4 1700000000000", "running", 4),  # with a timestamp, no labels
        ("vllm:num_requests_running{engine=\"0\"} not-a-number", "running", None),
        ('vllm:num_requests_running{engine="0"', "running", None),  # cut off mid-line
        ('vllm:cache_config_info{block_size="128",kv_cache_size_tokens="4096",num_gpu_blocks="None"} 1',
         "num_gpu_blocks", 32),
        ('vllm:cache_config_info{block_size="128",num_gpu_blocks="None"} 1', "num_gpu_blocks", None),
        ('vllm:cache_config_info{block_size="None",num_gpu_blocks="32"} 1', "num_gpu_blocks", None),
        ('vllm:cache_config_info{a="x \\" y",block_size="16",num_gpu_blocks="9"} 1', "num_gpu_blocks", 9),
    ],
)
def test_parse_is_tolerant_of_odd_lines(line: str, key: str, value: object) -> None:
    assert parse_vllm_metrics(line)[key] == value


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"object":"list","data":[{"id":"tiny","root":"/models/tiny","max_model_len":2048}]}',
         {"max_model_len": 2048, "model_id": "tiny", "model_root": "/models/tiny"}),
        (b'{"data":[{"id":"tiny"}]}', {"max_model_len": None, "model_id": "tiny", "model_root": None}),
        (b'{"data":[]}', {"max_model_len": None, "model_id": None, "model_root": None}),
        (b"<html>", {"max_model_len": None, "model_id": None, "model_root": None}),
        (b'{"data":[{"max_model_len":true,"id":5}]}', {"max_model_len": None, "model_id": None, "model_root": None}),
    ],
)
def test_parse_models_reads_the_first_model(body: bytes, expected: dict[str, Any]) -> None:
    assert parse_models(body) == expected


@pytest.mark.parametrize(
    ("previous", "current", "increase"),
    [(None, 5.0, 0.0), (5.0, None, 0.0), (5.0, 5.0, 0.0), (5.0, 8.0, 3.0), (9.0, 2.0, 2.0)],
    ids=["first-reading", "missing", "unchanged", "grew", "engine-restarted"],
)
def test_counter_increase(previous: float | None, current: float | None, increase: float) -> None:
    assert counter_increase(previous, current) == increase


# -- the view -------------------------------------------------------------------------------------
MODELS = orjson.dumps({"data": [{"id": "tiny", "root": "/m/tiny", "max_model_len": 2048}]})


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
        if path == "/v1/models":
            return 200, MODELS
        return 404, b"{}"


def make_view(upstream: FakeUpstream, clock: FakeClock, metrics: Metrics | None = None) -> EngineView:
    return EngineView(upstream, interval=0.25, stale_after=2.0, metrics=metrics or Metrics(), clock=clock)


def sample(metrics: Metrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(name)


async def test_refresh_builds_a_snapshot_from_metrics_and_models() -> None:
    clock = FakeClock()
    view = make_view(FakeUpstream(), clock)
    assert not view.snapshot.ok and view.is_stale()
    snap = await view.refresh()
    assert snap == EngineSnapshot(
        taken_at=100.0, ok=True, has_metrics=True, kv_usage=0.25, running=3, waiting=1, preemptions_total=9.0,
        generation_tokens_total=1234.0, num_gpu_blocks=32, block_size=128, max_model_len=2048,
        model_id="tiny", model_root="/m/tiny",
    )
    assert view.snapshot is snap and not view.is_stale()


async def test_models_are_fetched_once_and_again_after_a_failed_scrape() -> None:
    upstream = FakeUpstream()
    view = make_view(upstream, FakeClock())
    await view.refresh()
    await view.refresh()
    assert upstream.calls == ["/metrics", "/v1/models", "/metrics"]
    upstream.down = True
    await view.refresh()
    upstream.down = False
    upstream.calls.clear()
    await view.refresh()
    assert upstream.calls == ["/metrics", "/v1/models"]


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
    assert (snap.num_gpu_blocks, snap.block_size, snap.max_model_len, snap.model_id) == (32, 128, 2048, "tiny")
    assert sample(metrics, "vllm_guard_engine_scrape_errors_total") == 1.0


async def test_disable_log_stats_gives_an_ok_snapshot_without_metrics() -> None:
    view = make_view(FakeUpstream(DISABLED_TEXT), FakeClock())
    snap = await view.refresh()
    assert snap.ok and not snap.has_metrics
    assert (snap.kv_usage, snap.num_gpu_blocks, snap.max_model_len) == (None, None, 2048)


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
