"""``/metrics`` with --workers: every worker's counters and histograms added to the authority's, states by their
largest value, the authority's view of the engines and the books as it is."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gateway.config import Settings
from gateway.guard.parts import Parts
from gateway.metrics import Metrics
from gateway.workers.metrics_merge import families_of, render_merged


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
