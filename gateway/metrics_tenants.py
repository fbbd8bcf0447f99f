"""The tenants' Prometheus collectors (label values: the keys file's tenants and "default" only), declared on
the gateway's one registry by ``Metrics``; their ``record_*`` helpers."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

# The four counters of what each tenant was served: (name without ``_total``, help).
SERVED = (
    ("vllm_guard_tenant_requests", "Requests served, by tenant."),
    ("vllm_guard_tenant_prompt_tokens", "Prompt tokens of served requests, by tenant."),
    ("vllm_guard_tenant_completion_tokens", "Tokens generated for served requests, by tenant."),
    ("vllm_guard_tenant_queue_seconds", "Time served requests waited for admission, by tenant."),
)


class Served(NamedTuple):
    """What one tenant was served, as its usage book counts it; ``since``: when it was first served (unix time)."""

    requests: int
    prompt_tokens: int
    completion_tokens: int
    queue_seconds: float
    since: float


class ServedSource(Protocol):
    def served_by_tenant(self) -> Iterable[tuple[str, Served]]: ...


class ServedCollector(Collector):
    """``vllm_guard_tenant_{requests,prompt_tokens,completion_tokens,queue_seconds}_total``, read from the tenants'
    usage books (``tenants/usage.py``) when ``/metrics`` is collected rather than counted again on every request:
    four labelled counters' increments (a lookup and a lock each) were 29,000 of the workers' authority's 249,000
    instructions a short chat, for numbers the usage book already keeps. A tenant appears once it was served (as a
    counter's child appeared at its first increment), with its ``_created`` the time of that first request."""

    def __init__(self) -> None:
        self._sources: list[ServedSource] = []

    def attach(self, source: ServedSource) -> None:
        self._sources.append(source)

    def describe(self) -> Iterator[CounterMetricFamily]:
        for name, doc in SERVED:
            yield CounterMetricFamily(name, doc, labels=["tenant"])

    def collect(self) -> Iterator[CounterMetricFamily]:
        totals: dict[str, list[float]] = {}  # tenant -> the four sums, then the earliest first request
        for source in self._sources:
            for tenant, served in source.served_by_tenant():
                seen = totals.setdefault(tenant, [0.0, 0.0, 0.0, 0.0, served.since])
                for index in range(len(SERVED)):
                    seen[index] += served[index]
                seen[4] = min(seen[4], served.since)
        for index, (name, doc) in enumerate(SERVED):
            family = CounterMetricFamily(name, doc, labels=["tenant"])
            for tenant, values in totals.items():
                family.add_metric([tenant], float(values[index]), created=values[4])
            yield family


class TenantMetrics:
    def child(self, metric: Any, *labels: str) -> Any:  # defined by ``Metrics``
        raise NotImplementedError

    def _declare_tenants(self, r: CollectorRegistry) -> None:
        self.tenant_served = ServedCollector()
        r.register(self.tenant_served)
        self.tenant_rejections = Counter(
            "vllm_guard_tenant_rejections_total", "Requests refused, by tenant and reason.", ["tenant", "reason"],
            registry=r,
        )
        self.tenant_limits_degraded = Gauge(
            "vllm_guard_tenant_limits_degraded",
            "1 while Redis (--redis-url) is unreachable and each replica enforces tenant limits alone.", registry=r,
        )
        self.tenant_headroom_blocks = Gauge(
            "vllm_guard_tenant_headroom_blocks",
            "KV blocks the other tenants' requests leave free for this tenant's recent demand (--tenant-headroom).",
            ["tenant"], registry=r,
        )
        self.keys_reloads = Counter(
            "vllm_guard_keys_file_reloads_total", "Reloads of the keys file, by outcome (ok, error).", ["outcome"],
            registry=r,
        )

    def record_tenant_rejection(self, tenant: str, reason: str) -> None:
        self.tenant_rejections.labels(tenant, reason).inc()

    def record_tenant_limits_degraded(self, degraded: bool) -> None:
        self.tenant_limits_degraded.set(1 if degraded else 0)

    def record_tenant_headroom(self, tenant: str, blocks: int) -> None:
        self.tenant_headroom_blocks.labels(tenant).set(blocks)

    def record_keys_reload(self, ok: bool) -> None:
        self.keys_reloads.labels("ok" if ok else "error").inc()
