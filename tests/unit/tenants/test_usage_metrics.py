"""What each tenant was served reaches ``/metrics`` as four counters read from the usage book when collected: a
tenant appears once it was served, with the book's numbers, from the time of its first request; a tenant only
refused appears in the refusals alone; two books on one registry (a worker's keys-only book beside the
authority's) add up."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import Metrics
from gateway.tenants.usage import UsageBook
from tests.support.clock import FakeClock

SERVED = ("requests", "prompt_tokens", "completion_tokens", "queue_seconds")


def scraped(metrics: Metrics) -> dict[str, float]:
    """Every tenant sample of the exposition, by sample name and tenant."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics.render()[0].decode()):
        for s in family.samples:
            if s.name.startswith("vllm_guard_tenant_") and "tenant" in s.labels:
                out[f"{s.name}/{s.labels['tenant']}"] = s.value
    return out


def test_a_tenant_served_is_counted_from_its_first_request() -> None:
    metrics, clock = Metrics(), FakeClock(1_800_000_000.0)
    book = UsageBook(metrics, clock)
    clock.now += 5.0
    book.served("search", 100, 20, 0.5)
    clock.now += 5.0
    book.served("search", 50, 10, 0.25)

    seen = scraped(metrics)

    assert [seen[f"vllm_guard_tenant_{name}_total/search"] for name in SERVED] == [2.0, 150.0, 30.0, 0.75]
    assert {seen[f"vllm_guard_tenant_{name}_created/search"] for name in SERVED} == {1_800_000_005.0}


def test_a_tenant_only_refused_has_no_served_counters() -> None:
    metrics = Metrics()
    book = UsageBook(metrics, FakeClock(1_800_000_000.0))
    book.rejected("batch", "tenant_requests_per_minute")

    seen = scraped(metrics)

    assert seen["vllm_guard_tenant_rejections_total/batch"] == 1.0
    assert not [name for name in seen if name.startswith("vllm_guard_tenant_requests")]


def test_the_families_are_declared_before_anything_is_served() -> None:
    text = Metrics().render()[0].decode()

    for name in SERVED:
        assert f"# TYPE vllm_guard_tenant_{name}_total counter" in text


def test_two_books_on_one_registry_add_up_from_the_earlier_first_request() -> None:
    metrics = Metrics()
    UsageBook(metrics, FakeClock(1_800_000_010.0)).served("default", 10, 1, 0.0)
    UsageBook(metrics, FakeClock(1_800_000_000.0)).served("default", 20, 2, 1.0)

    seen = scraped(metrics)

    assert [seen[f"vllm_guard_tenant_{name}_total/default"] for name in SERVED] == [2.0, 30.0, 3.0, 1.0]
    assert seen["vllm_guard_tenant_requests_created/default"] == 1_800_000_000.0
