"""What each tenant used, for billing: requests served, prompt and completion tokens, refusals by reason and
time spent queued. Counted by this replica since it started (``GET /guard/usage``); the same numbers are
Prometheus counters with a ``tenant`` label, which add up across replicas."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from gateway.metrics import Metrics
from gateway.metrics_tenants import Served


@dataclass(slots=True)
class TenantUsage:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_seconds: float = 0.0
    rejections: dict[str, int] = field(default_factory=dict)
    first_served: float = 0.0  # unix time of its first request served (0 until then)

    def as_json(self) -> dict[str, object]:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "queue_seconds": round(self.queue_seconds, 3),
            "rejections": dict(sorted(self.rejections.items())),
        }


class UsageBook:
    """Per-tenant counters. Tenants come only from the keys file (and ``default``), so the label's values
    stay as few as the file's tenants."""

    def __init__(self, metrics: Metrics, clock: Callable[[], float] = time.time) -> None:
        self._metrics = metrics
        self._clock = clock
        self._tenants: dict[str, TenantUsage] = {}
        self.since = clock()
        metrics.tenant_served.attach(self)  # the served counters are these numbers, read when collected

    def _of(self, tenant: str) -> TenantUsage:
        usage = self._tenants.get(tenant)
        if usage is None:
            usage = self._tenants[tenant] = TenantUsage()
        return usage

    def served(self, tenant: str, prompt_tokens: int, completion_tokens: int, queue_seconds: float) -> None:
        usage = self._of(tenant)
        if not usage.requests:
            usage.first_served = self._clock()
        usage.requests += 1
        usage.prompt_tokens += prompt_tokens
        usage.completion_tokens += completion_tokens
        usage.queue_seconds += queue_seconds

    def rejected(self, tenant: str, reason: str) -> None:
        usage = self._of(tenant)
        usage.rejections[reason] = usage.rejections.get(reason, 0) + 1
        self._metrics.record_tenant_rejection(tenant, reason)

    def served_by_tenant(self) -> Iterator[tuple[str, Served]]:
        """Every tenant served at least once, with what it was served (``vllm_guard_tenant_*_total``)."""
        for name, usage in list(self._tenants.items()):
            if usage.requests:
                yield name, Served(usage.requests, usage.prompt_tokens, usage.completion_tokens,
                                   usage.queue_seconds, usage.first_served)

    def report(self, tenants: Iterable[str]) -> dict[str, dict[str, object]]:
        """Every tenant named in ``tenants`` (those of the keys file: zero for one that sent nothing) and every
        tenant that used anything."""
        names = sorted(set(tenants) | set(self._tenants))
        return {name: self._tenants.get(name, TenantUsage()).as_json() for name in names}
