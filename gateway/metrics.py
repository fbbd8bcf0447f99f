"""Every Prometheus collector of the gateway, on its own registry, with small ``record_*`` helpers.

Names: ``vllm_guard_*``, units in names, counters end in ``_total`` (Prometheus naming practice).
One ``Metrics`` object per app (no module-level registry), so tests and several apps never collide.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gateway.metrics_tenants import TenantMetrics

# Token counts span 1 .. 128K+: powers of two give equal resolution per doubling.
TOKEN_BUCKETS = tuple(float(2**i) for i in range(4, 19))  # 16 .. 262144
# Tokenization runs from ~50 us (short chat) to ~50 ms (32K tokens).
TOKENIZE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
# Event loop lag: ~0.1 ms on an idle gateway; past 0.25 s every client notices.
LOOP_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# Upstream latency: from sub-ms (cached, tiny) through minutes (long generations).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# Time to first token: prefill of long prompts under load takes seconds, queueing can add more.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
# Queue wait: zero for most, then up to --queue-timeout (30 s default).
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)

UPSTREAM_STATES = ("starting", "ready", "draining", "restarting", "down")
ENGINE_STATES = (*UPSTREAM_STATES, "hung", "mismatched")
# Raw values kept for the live page's percentiles between two of its samples (history.py empties them each
# second); bounded, so a gateway nobody samples holds no more than this.
RECENT_VALUES = 4096


class Metrics(TenantMetrics):
    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        r = self.registry = CollectorRegistry(auto_describe=True)
        # -- requests -----------------------------------------------------------------------------
        self.requests = Counter(
            "vllm_guard_requests_total", "Requests answered, by route and outcome.", ["route", "outcome"],
            registry=r,
        )
        self.rejections = Counter(
            "vllm_guard_rejections_total", "Requests refused by the gateway, by reason.", ["reason"], registry=r
        )
        self.truncations = Counter(
            "vllm_guard_truncations_total", "Prompts truncated to fit, by route.", ["route"], registry=r
        )
        self.truncated_tokens = Counter(
            "vllm_guard_truncated_tokens_total", "Prompt tokens removed by truncation.", registry=r
        )
        self.clamps = Counter(
            "vllm_guard_max_tokens_clamped_total",
            "Requests whose max_tokens was lowered (or set, when omitted) to fit.",
            ["route"],
            registry=r,
        )
        self.prompt_tokens = Histogram(
            "vllm_guard_prompt_tokens", "Prompt tokens per request, as counted by the gateway.",
            buckets=TOKEN_BUCKETS, registry=r,
        )
        self.max_tokens = Histogram(
            "vllm_guard_max_tokens", "max_tokens sent upstream per request (after clamping).",
            buckets=TOKEN_BUCKETS, registry=r,
        )
        self.output_tokens = Histogram(
            "vllm_guard_output_tokens", "Completion tokens per request, from the upstream's usage.",
            buckets=TOKEN_BUCKETS, registry=r,
        )
        self.tokenize_seconds = Histogram(
            "vllm_guard_tokenization_seconds", "Time to count a request's prompt tokens.",
            buckets=TOKENIZE_BUCKETS, registry=r,
        )
        # A histogram, not a gauge of the latest reading: a stall between two scrapes still shows in its buckets.
        self.loop_lag = Histogram(
            "vllm_guard_event_loop_lag_seconds", "How much later than due the event loop woke a timer (every 0.1 s).",
            buckets=LOOP_LAG_BUCKETS, registry=r,
        )
        self.upstream_seconds = Histogram(
            "vllm_guard_upstream_latency_seconds", "Upstream time from request sent to last byte, by route.",
            ["route"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.ttft_seconds = Histogram(
            "vllm_guard_time_to_first_token_seconds", "Upstream time from request sent to first streamed chunk.",
            ["route"], buckets=TTFT_BUCKETS, registry=r,
        )
        self.in_flight = Gauge(
            "vllm_guard_in_flight_requests", "Guarded requests being served upstream now.", registry=r
        )
        self.tokenizer_fallback = Gauge(
            "vllm_guard_tokenizer_fallback", "1 when counting uses the upstream's /tokenize (no local tokenizer).",
            registry=r,
        )
        # -- KV admission -------------------------------------------------------------------------
        self.kv_capacity = Gauge(
            "vllm_guard_kv_capacity_blocks", "Engine KV capacity in blocks.", registry=r
        )
        self.kv_budget = Gauge(
            "vllm_guard_kv_budget_blocks", "Blocks the gateway may commit (kv_target x capacity).", registry=r
        )
        self.kv_committed = Gauge(
            "vllm_guard_kv_committed_blocks", "Blocks reserved by admitted requests.", registry=r
        )
        self.kv_live_used = Gauge(
            "vllm_guard_kv_live_used_blocks", "Blocks the engine reports in use (live).", registry=r
        )
        self.kv_admit_limit = Gauge(
            "vllm_guard_kv_admit_limit_blocks", "Current admission limit of the policy, in blocks.", registry=r
        )
        self.kv_logical = Gauge(
            "vllm_guard_kv_logical_committed_blocks",
            "Blocks the admitted requests would hold without prefix sharing (each its whole prompt).", registry=r,
        )
        self.kv_shared = Gauge(
            "vllm_guard_kv_shared_blocks", "Prompt blocks held by admitted requests, each counted once.", registry=r
        )
        # -- each engine, when the gateway guards several (label ``engine``: one per engine, bounded) ---------
        self.engine_committed = Gauge(
            "vllm_guard_engine_committed_blocks", "Blocks reserved on each engine.", ["engine"], registry=r
        )
        self.engine_budget = Gauge(
            "vllm_guard_engine_budget_blocks", "Blocks the gateway may commit on each engine.", ["engine"], registry=r
        )
        self.engine_in_flight = Gauge(
            "vllm_guard_engine_in_flight_requests", "Requests admitted to each engine.", ["engine"], registry=r
        )
        self.engine_admitted = Gauge(
            "vllm_guard_engine_admitted_requests", "Requests admitted to each engine since start.", ["engine"],
            registry=r,
        )
        self.engine_state = Gauge(
            "vllm_guard_engine_state",
            "Each engine's state (1 for the current one): ready, starting, draining, restarting, down, hung or "
            "mismatched.", ["engine", "state"], registry=r,
        )
        self.failovers = Counter(
            "vllm_guard_failovers", "Requests sent to another engine after theirs failed before answering.",
            registry=r,
        )
        self.foreign_sequences = Gauge(
            "vllm_guard_engine_foreign_sequences",
            "Sequences the engine runs or queues beyond the gateway's own (traffic that bypasses the gateway).",
            registry=r,
        )
        self.foreign_preemptions = Counter(
            "vllm_guard_engine_foreign_preemptions",
            "Engine preemptions seen while traffic that bypasses the gateway ran (not held against admission).",
            registry=r,
        )
        self.queue_depth = Gauge(
            "vllm_guard_queue_depth", "Requests waiting for capacity, by priority.", ["priority"], registry=r
        )
        self.queue_wait = Histogram(
            "vllm_guard_queue_wait_seconds", "Time requests waited for admission.",
            buckets=QUEUE_BUCKETS, registry=r,
        )
        self.admissions = Counter(
            "vllm_guard_admissions_total", "Requests admitted, by how (immediate or queued).", ["how"], registry=r
        )
        self.engine_preemptions = Counter(
            "vllm_guard_engine_preemptions_total", "Preemptions the engine reported while the gateway watched.",
            registry=r,
        )
        self.scrape_errors = Counter(
            "vllm_guard_engine_scrape_errors_total", "Failed scrapes of the engine's /metrics.", registry=r
        )
        self.engine_metrics_age = Gauge(
            "vllm_guard_engine_metrics_age_seconds", "Age of the newest engine metrics snapshot.", registry=r
        )
        self.engine_metrics_stale = Gauge(
            "vllm_guard_engine_metrics_stale", "1 when engine metrics are stale and only the ledger is used.",
            registry=r,
        )
        # -- upstream lifecycle -------------------------------------------------------------------
        self.upstream_state = Gauge(
            "vllm_guard_upstream_state", "1 for the upstream's current state.", ["state"], registry=r
        )
        self.upstream_up = Gauge("vllm_guard_upstream_up", "1 when the upstream is ready.", registry=r)
        self.restarts = Counter(
            "vllm_guard_restarts_total", "Restarts of the managed engine, by reason.", ["reason"], registry=r
        )
        self.startup_seconds = Gauge(
            "vllm_guard_engine_startup_seconds", "Time the last (re)start of the managed engine took.",
            registry=r,
        )
        # -- hung engines (gateway/engine/progress.py) --------------------------------------------
        self.engine_hung = Gauge(
            "vllm_guard_engine_hung", "1 while the engine makes no progress though work runs (refused, 503).",
            registry=r,
        )
        self.engine_hangs = Counter(
            "vllm_guard_engine_hangs_total", "Times the engine was declared hung.", registry=r
        )
        # -- what an inference gateway's endpoint picker reads (docs/scale-out.md) ----------------
        self.pool_queued = Gauge(
            "vllm_guard_pool_queued_requests",
            "Requests waiting: in the engine's own queue plus in the gateway's (the picker's queue depth).",
            registry=r,
        )
        self.pool_running = Gauge(
            "vllm_guard_pool_running_requests",
            "Requests the engine runs (the gateway's in flight when the engine's metrics are stale).", registry=r,
        )
        self.pool_kv_usage = Gauge(
            "vllm_guard_pool_kv_usage_ratio",
            "KV cache in use, 0..1: the larger of the engine's live usage and the gateway's reservations.",
            registry=r,
        )
        self.cache_config_info = Gauge(
            "vllm_guard_cache_config_info", "1, labelled with the engine's KV block size and blocks, as "
            "vllm:cache_config_info.", ["block_size", "num_gpu_blocks"], registry=r,
        )
        self.booking_quantile = Gauge(
            "vllm_guard_admission_booking_quantile", "Quantile of the answers' real lengths the adaptive policy "
            "books requests at (1: the worst case, max_tokens), set by the preemption budget.", registry=r,
        )
        self.admission_reach = Gauge(
            "vllm_guard_admission_reach", "How far past the KV budget the adaptive policy lets its projected peak "
            "go, as a share of the budget, while the engine has room the projection does not see.", registry=r,
        )
        self.preemption_rate = Gauge(
            "vllm_guard_engine_preemptions_per_100_requests", "Engine preemptions per 100 requests completed "
            "over the last 30 s, as held against --preemption-budget.", registry=r,
        )
        self._declare_tenants(r)
        # -- recent values for the live page (not collectors) -------------------------------------
        self.recent_ttft: deque[float] = deque(maxlen=RECENT_VALUES)
        self.recent_queue_wait: deque[float] = deque(maxlen=RECENT_VALUES)
        self.set_upstream_state("starting")

    # -- helpers ----------------------------------------------------------------------------------
    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, remembered: prometheus_client checks and builds the label tuple on every
        call (~3 us), and the request path records a dozen labelled values. Label values are bounded (routes,
        outcomes, reasons, the keys file's tenants), so is this."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def record_request(self, route: str, outcome: str) -> None:
        self.child(self.requests, route, outcome).inc()

    def record_rejection(self, reason: str) -> None:
        self.child(self.rejections, reason).inc()

    def record_counted(self, prompt_tokens: int, seconds: float) -> None:
        self.prompt_tokens.observe(prompt_tokens)
        self.tokenize_seconds.observe(seconds)

    def record_loop_lag(self, seconds: float) -> None:
        self.loop_lag.observe(seconds)

    def record_truncation(self, route: str, removed_tokens: int) -> None:
        self.truncations.labels(route).inc()
        self.truncated_tokens.inc(removed_tokens)

    def record_max_tokens(self, route: str, max_tokens: int, clamped: bool) -> None:
        self.max_tokens.observe(max_tokens)
        if clamped:
            self.clamps.labels(route).inc()

    def record_output_tokens(self, tokens: int) -> None:
        self.output_tokens.observe(tokens)

    def record_upstream_latency(self, route: str, seconds: float) -> None:
        self.child(self.upstream_seconds, route).observe(seconds)

    def record_ttft(self, route: str, seconds: float) -> None:
        self.child(self.ttft_seconds, route).observe(seconds)
        self.recent_ttft.append(seconds)

    def record_tokenizer_fallback(self, active: bool) -> None:
        self.tokenizer_fallback.set(1 if active else 0)

    def record_kv(
        self, *, capacity: int, budget: int, committed: int, live_used: int | None, admit_limit: int
    ) -> None:
        self.kv_capacity.set(capacity)
        self.kv_budget.set(budget)
        self.kv_committed.set(committed)
        if live_used is not None:
            self.kv_live_used.set(live_used)
        self.kv_admit_limit.set(admit_limit)

    def record_engines(self, rows: list[tuple[str, int, int | None, int, int]]) -> None:
        """Each engine's (name, committed, budget, in flight, admitted so far); engines gone are forgotten."""
        gauges = (self.engine_committed, self.engine_budget, self.engine_in_flight, self.engine_admitted)
        for gauge in gauges:
            gauge.clear()
        for name, *values in rows:
            for gauge, value in zip(gauges, values, strict=True):
                if value is not None:
                    gauge.labels(name).set(value)

    def record_engine_states(self, states: dict[str, str]) -> None:
        """Each engine's state, by engine name (only when there are several); engines gone are forgotten."""
        self.engine_state.clear()
        for name, state in states.items():
            for each in ENGINE_STATES:
                self.engine_state.labels(name, each).set(1 if each == state else 0)

    def record_failover(self) -> None:
        self.failovers.inc()

    def record_sharing(self, *, logical: int, shared: int) -> None:
        self.kv_logical.set(logical)
        self.kv_shared.set(shared)

    def record_foreign(self, sequences: int, preemptions: float) -> None:
        self.foreign_sequences.set(sequences)
        if preemptions > 0:
            self.foreign_preemptions.inc(preemptions)

    def record_preemption_control(self, quantile: float, preemptions_per_100: float, reach: float = 0.0) -> None:
        self.booking_quantile.set(quantile)
        self.admission_reach.set(reach)
        self.preemption_rate.set(preemptions_per_100)

    def record_queue_depth(self, depth_by_priority: dict[int, int]) -> None:
        self.queue_depth.clear()
        for prio, depth in depth_by_priority.items():
            self.queue_depth.labels(str(prio)).set(depth)

    def record_admission(self, how: str, waited_seconds: float) -> None:
        self.child(self.admissions, how).inc()
        self.queue_wait.observe(waited_seconds)
        self.recent_queue_wait.append(waited_seconds)

    def record_preemptions(self, count: float) -> None:
        if count > 0:
            self.engine_preemptions.inc(count)

    def record_scrape(self, ok: bool, age_seconds: float | None, stale: bool) -> None:
        if not ok:
            self.scrape_errors.inc()
        self.record_engine_freshness(age_seconds, stale)

    def record_engine_freshness(self, age_seconds: float | None, stale: bool) -> None:
        if age_seconds is not None:
            self.engine_metrics_age.set(age_seconds)
        self.engine_metrics_stale.set(1 if stale else 0)

    def set_upstream_state(self, state: str) -> None:
        for s in UPSTREAM_STATES:
            self.upstream_state.labels(s).set(1 if s == state else 0)
        self.upstream_up.set(1 if state == "ready" else 0)

    def record_restart(self, reason: str, startup_seconds: float | None = None) -> None:
        self.restarts.labels(reason).inc()
        if startup_seconds is not None:
            self.startup_seconds.set(startup_seconds)

    def record_engine_hung(self, hung: bool) -> None:
        self.engine_hung.set(1 if hung else 0)
        if hung:
            self.engine_hangs.inc()

    def record_pool(
        self, *, queued: int, running: int, kv_usage: float, block_size: int, num_gpu_blocks: int | None
    ) -> None:
        self.pool_queued.set(queued)
        self.pool_running.set(running)
        self.pool_kv_usage.set(kv_usage)
        self.cache_config_info.clear()  # one series: the capacity as it is now
        self.cache_config_info.labels(str(block_size), "" if num_gpu_blocks is None else str(num_gpu_blocks)).set(1)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
