"""The live page's history: bounded samples, rates and percentiles from the counters, upstream events."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.metrics import RECENT_VALUES, Metrics
from gateway.observe.history import (
    VALUES_PER_SAMPLE,
    Event,
    History,
    Sampler,
    counter_totals,
    percentiles,
    thinned,
)
from tests.support.clock import FakeClock, ManualSleep


class Gateway:
    """What the sampler reads: the admission status and the upstream status, set by the test."""

    def __init__(self) -> None:
        self.admission: dict[str, Any] = {
            "capacity_blocks": 100, "budget_blocks": 90, "committed_blocks": 0, "live_used_blocks": 0,
            "admit_limit_blocks": 90, "block_size": 16, "in_flight": 0, "queued": 0, "queued_by_priority": {},
            "engine": {"running": 0, "waiting": 0, "stale": False},
        }
        self.upstream: dict[str, Any] = {"state": "ready", "restarts": 0, "last_restart_reason": None}

    def admission_status(self) -> dict[str, Any]:
        return dict(self.admission)

    def upstream_status(self) -> dict[str, Any]:
        return dict(self.upstream)


def make_sampler(
    gw: Gateway, metrics: Metrics, clock: FakeClock, *, history: History | None = None, sleep: Any = None
) -> Sampler:
    return Sampler(
        history or History(), metrics, gw.admission_status, gw.upstream_status, clock=clock,
        wall=lambda: clock.now + 1_700_000_000.0, **({"sleep": sleep} if sleep is not None else {}),
    )


def numbered(history: History, count: int) -> None:
    for i in range(count):
        history.add({"n": i})


# -- History ----------------------------------------------------------------------------------------
def test_the_history_keeps_only_its_newest_samples() -> None:
    history = History(size=600)
    numbered(history, 700)
    kept = history.since(None)
    assert len(kept) == 600
    assert (kept[0]["id"], kept[-1]["id"]) == (101, 700)
    assert history.last_id == 700


@pytest.mark.parametrize(
    ("after", "ids"),
    [
        pytest.param(None, list(range(6, 11)), id="no-id-gives-everything-kept"),
        pytest.param(7, [8, 9, 10], id="an-id-gives-the-newer-samples"),
        pytest.param(10, [], id="the-newest-id-gives-nothing"),
        pytest.param(2, list(range(6, 11)), id="an-id-older-than-the-history-gives-everything-kept"),
        pytest.param(0, list(range(6, 11)), id="zero-gives-everything-kept"),
        pytest.param(99, list(range(6, 11)), id="an-id-never-given-gives-everything-after-a-restart"),
    ],
)
def test_since_returns_the_samples_after_an_id(after: int | None, ids: list[int]) -> None:
    history = History(size=5)
    numbered(history, 10)
    assert [s["id"] for s in history.since(after)] == ids


def test_an_empty_history_has_nothing_to_give() -> None:
    history = History()
    assert (history.since(None), history.since(3), history.last_id, history.latest) == ([], [], 0, None)


def test_events_are_bounded_and_given_after_an_id() -> None:
    history = History(size=10, events=3)
    numbered(history, 10)
    for i in range(1, 6):
        history.add_event(Event(id=i * 2, t=float(i), state="ready", restarts=i, reason=None))
    assert [e["id"] for e in history.events_since(None)] == [6, 8, 10]
    assert [e["id"] for e in history.events_since(7)] == [8, 10]


def test_a_history_must_hold_something() -> None:
    with pytest.raises(ValueError, match="at least one"):
        History(size=0)


# -- percentiles ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("values", "expected"),
    [
        pytest.param([], {"p50": None, "p90": None, "p99": None, "n": 0}, id="none"),
        pytest.param([7.0], {"p50": 7.0, "p90": 7.0, "p99": 7.0, "n": 1}, id="one"),
        pytest.param(
            [float(v) for v in range(100, 0, -1)], {"p50": 50.0, "p90": 90.0, "p99": 99.0, "n": 100},
            id="one-to-a-hundred-unordered",
        ),
        pytest.param([1.0, 2.0, 3.0, 1000.0], {"p50": 2.0, "p90": 1000.0, "p99": 1000.0, "n": 4}, id="a-tail"),
    ],
)
def test_percentiles_are_nearest_rank(values: list[float], expected: dict[str, Any]) -> None:
    assert percentiles(values) == expected


@pytest.mark.parametrize(("count", "most"), [(10, 20), (1000, 256), (257, 256), (4096, 256)])
def test_thinning_keeps_an_even_spread_of_at_most_the_limit(count: int, most: int) -> None:
    values = [float(v) for v in range(count)]
    kept = thinned(values, most)
    assert len(kept) == min(count, most)
    assert kept[0] == 0.0
    assert kept == sorted(kept)
    assert kept[-1] >= count * (1 - 1 / most) - 1


def test_counter_totals_reads_a_counter_by_its_labels() -> None:
    m = Metrics()
    m.record_rejection("queue_full")
    m.record_rejection("queue_full")
    m.record_rejection("context_length")
    m.record_preemptions(3)
    assert counter_totals(m.rejections) == {"queue_full": 2.0, "context_length": 1.0}
    assert counter_totals(m.engine_preemptions) == {"": 3.0}


# -- the sampler ------------------------------------------------------------------------------------
def test_a_sample_shows_what_the_status_shows() -> None:
    gw, clock = Gateway(), FakeClock()
    gw.admission.update(committed_blocks=40, live_used_blocks=25, in_flight=3, queued=2,
                        queued_by_priority={"1": 1, "0": 1})
    sample = make_sampler(gw, Metrics(), clock).sample()
    assert sample["id"] == 1
    assert sample["t"] == 1_700_001_000.0
    assert sample["kv"] == {
        "capacity": 100, "budget": 90, "committed": 40, "live_used": 25, "admit_limit": 90, "block_size": 16
    }
    assert (sample["in_flight"], sample["queued"], sample["queued_by_priority"]) == (3, 2, {"1": 1, "0": 1})
    assert sample["upstream"] == {"state": "ready", "restarts": 0, "last_restart_reason": None}


def test_rates_are_counter_increases_per_second_between_samples() -> None:
    gw, clock, m = Gateway(), FakeClock(), Metrics()
    sampler = make_sampler(gw, m, clock)
    m.record_admission("immediate", 0.0)  # before the first sample: part of no rate
    first = sampler.sample()
    assert all(v == {} for v in first["rates"].values())
    for _ in range(4):
        m.record_admission("immediate", 0.0)
    m.record_admission("queued", 0.5)
    m.record_rejection("queue_full")
    m.record_rejection("queue_full")
    m.record_max_tokens("chat", 10, clamped=True)
    m.record_max_tokens("completions", 10, clamped=True)
    m.record_truncation("chat", 100)
    m.record_request("chat", "ok")
    m.record_request("chat", "rejected")
    m.record_preemptions(6)
    clock.now += 2.0
    rates = sampler.sample()["rates"]
    assert rates == {
        "admitted": {"immediate": 2.0, "queued": 0.5},
        "rejected": {"queue_full": 1.0},
        "clamped": {"": 1.0},
        "truncated": {"": 0.5},
        "completed": {"": 0.5},
        "preempted": {"": 3.0},
    }
    clock.now += 1.0
    assert all(v == {} for v in sampler.sample()["rates"].values())


def test_percentiles_cover_the_trailing_window_and_take_each_value_once() -> None:
    gw, clock, m = Gateway(), FakeClock(), Metrics()
    sampler = make_sampler(gw, m, clock)
    for seconds in (0.1, 0.2, 0.3):
        m.record_ttft("chat", seconds)
    m.record_admission("queued", 2.0)
    sample = sampler.sample()
    assert sample["ttft_ms"] == {"p50": 200.0, "p90": 300.0, "p99": 300.0, "n": 3}
    assert sample["queue_wait_ms"] == {"p50": 2000.0, "p90": 2000.0, "p99": 2000.0, "n": 1}
    assert len(m.recent_ttft) == 0 and len(m.recent_queue_wait) == 0
    m.record_ttft("chat", 1.0)
    assert sampler.sample()["ttft_ms"]["n"] == 4  # the earlier second is still in the window
    for _ in range(60):
        clock.now += 1.0
        last = sampler.sample()
    assert last["ttft_ms"] == {"p50": None, "p90": None, "p99": None, "n": 0}


def test_a_busy_second_is_thinned_before_the_percentiles() -> None:
    gw, clock, m = Gateway(), FakeClock(), Metrics()
    for i in range(RECENT_VALUES + 100):  # more than the metrics keep between samples
        m.record_ttft("chat", i / 1000.0)
    sample = make_sampler(gw, m, clock).sample()
    assert sample["ttft_ms"]["n"] == VALUES_PER_SAMPLE
    assert sample["ttft_ms"]["p99"] is not None and sample["ttft_ms"]["p99"] >= 3900.0


def test_upstream_changes_and_restarts_become_events_with_their_reason() -> None:
    gw, clock = Gateway(), FakeClock()
    history = History()
    sampler = make_sampler(gw, Metrics(), clock, history=history)
    sampler.sample()
    sampler.sample()  # nothing changed: no event
    gw.upstream = {"state": "draining", "restarts": 0, "last_restart_reason": None}
    sampler.sample()
    gw.upstream = {"state": "ready", "restarts": 1, "last_restart_reason": "hang"}
    sampler.sample()
    events = history.events_since(None)
    assert [(e["id"], e["state"], e["restarts"], e["reason"]) for e in events] == [
        (1, "ready", 0, None), (3, "draining", 0, None), (4, "ready", 1, "hang"),
    ]
    assert history.events_since(3) == [events[-1]]


async def test_the_sampler_samples_each_interval_until_stopped() -> None:
    gw, clock, sleep = Gateway(), FakeClock(), ManualSleep()
    sampler = make_sampler(gw, Metrics(), clock, sleep=sleep)
    await sampler.start()
    await asyncio.sleep(0)
    assert sampler.history.last_id == 0  # nothing before the first interval: the engine's state is unknown
    await sleep.wake_and_run()
    assert sampler.history.last_id == 1
    await sleep.wake_and_run()
    assert sampler.history.last_id == 2
    assert sleep.delays[:2] == [1.0, 1.0]
    assert sampler._timer.running
    await sampler.stop()
    assert not sampler._timer.running
    await sampler.stop()  # twice is harmless


async def test_a_failing_sample_does_not_end_the_history(caplog: pytest.LogCaptureFixture) -> None:
    gw, clock, sleep = Gateway(), FakeClock(), ManualSleep()
    calls = 0

    def flaky() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("boom")
        return gw.admission_status()

    sampler = Sampler(History(), Metrics(), flaky, gw.upstream_status, clock=clock, sleep=sleep)
    await sampler.start()
    await asyncio.sleep(0)
    await sleep.wake_and_run()
    await sleep.wake_and_run()
    assert sampler.history.last_id == 1
    assert "sampling the gateway for /guard/ui failed" in caplog.text
    await sampler.stop()
