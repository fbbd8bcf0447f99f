"""The tenants' Prometheus collectors (label values: the keys file's tenants and "default" only), declared on
the gateway's one registry by ``Metrics``; their ``record_*`` helpers."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge


class TenantMetrics:
    def child(self, metric: Any, *labels: str) -> Any:  # defined by ``Metrics``
        raise NotImplementedError

    def _declare_tenants(self, r: CollectorRegistry) -> None:
        self.tenant_requests = Counter(
            "vllm_guard_tenant_requests_total", "Requests served, by tenant.", ["tenant"], registry=r
        )
        self.tenant_prompt_tokens = Counter(
            "vllm_guard_tenant_prompt_tokens_total", "Prompt tokens of served requests, by tenant.", ["tenant"],
            registry=r,
        )
        self.tenant_completion_tokens = Counter(
            "vllm_guard_tenant_completion_tokens_total", "Tokens generated for served requests, by tenant.",
            ["tenant"], registry=r,
        )
        self.tenant_queue_seconds = Counter(
            "vllm_guard_tenant_queue_seconds_total", "Time served requests waited for admission, by tenant.",
            ["tenant"], registry=r,
        )
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

    def record_tenant_usage(self, tenant: str, prompt_tokens: int, completion_tokens: int, queued: float) -> None:
        child = self.child
        child(self.tenant_requests, tenant).inc()
        child(self.tenant_prompt_tokens, tenant).inc(prompt_tokens)
        child(self.tenant_completion_tokens, tenant).inc(completion_tokens)
        child(self.tenant_queue_seconds, tenant).inc(queued)

    def record_tenant_rejection(self, tenant: str, reason: str) -> None:
        self.tenant_rejections.labels(tenant, reason).inc()

    def record_tenant_limits_degraded(self, degraded: bool) -> None:
        self.tenant_limits_degraded.set(1 if degraded else 0)

    def record_tenant_headroom(self, tenant: str, blocks: int) -> None:
        self.tenant_headroom_blocks.labels(tenant).set(blocks)

    def record_keys_reload(self, ok: bool) -> None:
        self.keys_reloads.labels("ok" if ok else "error").inc()
