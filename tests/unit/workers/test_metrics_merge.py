"""``/metrics`` with --workers: every worker's counters and histograms added to the authority's, states by their
largest value, the authority's view of the engines and the books as it is; a dead worker's counts kept, its
gauges gone."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import Settings
from gateway.guard.parts import Parts
from gateway.metrics import Metrics
from gateway.workers.metrics_merge import WorkerCounts, families_of, render_merged


def worker(requests: int, *, fallback: bool = False, in_flight: int = 0) -> list[Any]:
    metrics = Metrics()
    for _ in range(requests):
        metrics.record_request("chat", "ok")
        metrics.record_ttft("chat", 0.02)
    metrics.record_tokenizer_fallback(fallback)
    metrics.in_flight.set(in_flight)
    metrics.kv_capacity.set(999)  # a worker's view of the books: never reported
    return families_of(Parts(Settings(), metrics, None, None))  # type: ignore[arg-type]


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }


def test_every_process_adds_up_and_the_authoritys_books_stay_its_own() -> None:
    authority = Metrics()
    authority.record_request("chat", "ok")
    authority.kv_capacity.set(32)
    data, _ = render_merged(authority, [worker(2, in_flight=3), worker(4, fallback=True, in_flight=1)])
    got = samples(data.decode())
    assert got[("vllm_guard_requests_total", (("outcome", "ok"), ("route", "chat")))] == 7
    assert got[("vllm_guard_time_to_first_token_seconds_count", (("route", "chat"),))] == 6
    assert got[("vllm_guard_time_to_first_token_seconds_bucket", (("le", "0.025"), ("route", "chat")))] == 6
    assert got[("vllm_guard_in_flight_requests", ())] == 4
    assert got[("vllm_guard_tokenizer_fallback", ())] == 1  # a state: the largest, not the sum
    assert got[("vllm_guard_kv_capacity_blocks", ())] == 32


def test_a_series_only_a_worker_has_is_reported_too() -> None:
    data, _ = render_merged(Metrics(), [worker(1)])
    got = samples(data.decode())
    assert got[("vllm_guard_requests_total", (("outcome", "ok"), ("route", "chat")))] == 1


# -- a worker that dies: its counts stay, its gauges go ------------------------------------------------
def kinds(text: str) -> dict[str, str]:
    return {s.name: family.type for family in text_string_to_metric_families(text) for s in family.samples}


def render(authority: Metrics, counts: WorkerCounts) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return samples(render_merged(authority, counts.families())[0].decode())


def assert_nothing_counts_down(before: dict[Any, float], after: dict[Any, float], text: str) -> None:
    """Every counter's and histogram's sample (``_created`` aside: when the series began) is no lower."""
    of = kinds(text)
    for key, value in before.items():
        name = key[0]
        if of.get(name) in ("counter", "histogram") and not name.endswith("_created"):
            assert after.get(key, 0.0) >= value, (key, value, after.get(key))


def test_a_dead_workers_counters_and_histograms_stay_in_the_total_and_its_gauges_go() -> None:
    authority, counts = Metrics(), WorkerCounts()
    authority.record_request("chat", "ok")
    one, two = object(), object()
    counts.seen(one, worker(5, in_flight=2, fallback=True))
    counts.seen(two, worker(3, in_flight=1))
    before = render(authority, counts)
    assert before[("vllm_guard_requests_total", (("outcome", "ok"), ("route", "chat")))] == 9
    counts.lost(one)
    after = render(authority, counts)
    assert after[("vllm_guard_requests_total", (("outcome", "ok"), ("route", "chat")))] == 9
    assert after[("vllm_guard_time_to_first_token_seconds_count", (("route", "chat"),))] == 8
    assert after[("vllm_guard_time_to_first_token_seconds_bucket", (("le", "0.025"), ("route", "chat")))] == 8
    assert after[("vllm_guard_in_flight_requests", ())] == 1  # the dead worker's requests are no longer in flight
    assert after[("vllm_guard_tokenizer_fallback", ())] == 0
    assert_nothing_counts_down(before, after, render_merged(authority, counts.families())[0].decode())


def test_a_restarted_worker_counts_from_zero_on_top_of_the_dead_ones() -> None:
    counts = WorkerCounts()
    first = object()
    counts.seen(first, worker(6))
    counts.lost(first)
    counts.lost(first)  # told twice: counted once
    counts.seen(object(), worker(2))
    got = render(Metrics(), counts)
    assert got[("vllm_guard_requests_total", (("outcome", "ok"), ("route", "chat")))] == 8
    assert got[("vllm_guard_time_to_first_token_seconds_sum", (("route", "chat"),))] == pytest.approx(8 * 0.02)


def test_every_death_adds_to_the_retired_total() -> None:
    counts = WorkerCounts()
    for requests in (1, 2, 4):
        gone = object()
        counts.seen(gone, worker(requests))
        counts.lost(gone)
    got = render(Metrics(), counts)
    assert got[("vllm_guard_requests_total", (("outcome", "ok"), ("route", "chat")))] == 7
    assert ("vllm_guard_in_flight_requests", ()) in got  # the authority's own gauge, alone


def test_a_worker_is_reported_at_its_newest_snapshot_until_it_answers_again() -> None:
    counts, one = WorkerCounts(), object()
    counts.seen(one, worker(3))
    got = render(Metrics(), counts)  # no fresh reply this time (it missed the scrape's deadline): its newest
    assert got[("vllm_guard_requests_total", (("outcome", "ok"), ("route", "chat")))] == 3
    counts.seen(one, worker(4))
    got = render(Metrics(), counts)
    assert got[("vllm_guard_requests_total", (("outcome", "ok"), ("route", "chat")))] == 4


def test_a_worker_never_seen_leaves_nothing_behind() -> None:
    counts = WorkerCounts()
    counts.lost(object())
    assert counts.families() == []
