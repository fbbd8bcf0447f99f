"""The upstream view: scrapes vLLM's ``/metrics`` into immutable, timestamped snapshots.

Admission reads live KV usage and preemptions from here; capacity comes from ``vllm:cache_config_info``.
Scraping is async on a timer; a failed scrape produces a snapshot with ``ok=False`` that keeps the
engine's static facts (its capacity) so that a short outage does not forget them, while the live fields
are ``None``. Whoever reads live fields must check :meth:`EngineView.is_stale`.

Whether the engine answers at all (:meth:`EngineView.answering`, what ``/health`` and admission judge it down by)
is another question than staleness: ``FAILED_SCRAPES_DOWN`` scrapes failed in a row (refused, an HTTP error, a
timeout). Not one failure, nor an old snapshot: when the gateway's own loop runs late (a busy host), its scrape's
timer fires before the answer sitting in the socket is read and every snapshot ages, while the engine was fine;
the scrape after it, a scrape interval later, tells. An engine killed is down within two scrape intervals; one
that takes connections and never answers, within two scrape timeouts. The served models are not
part of a snapshot: ``gateway.engine.models`` holds them, and follows the snapshots to re-read them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace

from gateway.engine.queue_cap import QueueCap
from gateway.engine.vllm_api import EngineMetrics, RankMetrics, parse_metrics
from gateway.errors import GatewayError
from gateway.metrics import Metrics
from gateway.periodic import Periodic

log = logging.getLogger(__name__)

Fetch = Callable[[str], Awaitable[tuple[int, bytes]]]
SnapshotListener = Callable[["EngineSnapshot", "EngineSnapshot"], None]

METRICS_PATH = "/metrics"
# Scrapes failed in a row that make the engine down (see the module's docstring).
FAILED_SCRAPES_DOWN = 2


@dataclass(frozen=True)
class EngineSnapshot:
    taken_at: float
    ok: bool
    has_metrics: bool
    kv_usage: float | None
    running: int | None
    waiting: int | None
    preemptions_total: float | None
    generation_tokens_total: float | None
    num_gpu_blocks: int | None
    block_size: int | None
    prefix_caching: bool | None = None  # the engine's enable_prefix_caching; None when it does not say
    prefix_cache_queries_total: float | None = None  # tokens looked up in the prefix cache
    prefix_cache_hits_total: float | None = None  # of those, tokens found
    prompt_tokens_total: float | None = None  # prefilled tokens, counted as each prefill completes (progress)
    ranks: Mapping[str, RankMetrics] = field(default_factory=dict)  # each data-parallel engine's own figures
    # vLLM's own queue cap (0.29+): requests it refused, by reason (vllm:admission_rejections_total)
    admission_rejections: Mapping[str, float] = field(default_factory=dict)


def never_scraped(at: float) -> EngineSnapshot:
    return EngineSnapshot(
        taken_at=at, ok=False, has_metrics=False, kv_usage=None, running=None, waiting=None,
        preemptions_total=None, generation_tokens_total=None, num_gpu_blocks=None, block_size=None,
    )


def snapshot_of(at: float, page: EngineMetrics) -> EngineSnapshot:
    """A successful scrape's snapshot: what admission and the watchdog read from the page."""
    return EngineSnapshot(
        taken_at=at, ok=True, has_metrics=page.has_metrics, kv_usage=page.kv_usage, running=page.running,
        waiting=page.waiting, preemptions_total=page.preemptions_total,
        generation_tokens_total=page.generation_tokens_total, num_gpu_blocks=page.num_gpu_blocks,
        block_size=page.block_size, prefix_caching=page.prefix_caching,
        prefix_cache_queries_total=page.prefix_cache_queries_total,
        prefix_cache_hits_total=page.prefix_cache_hits_total,
        prompt_tokens_total=page.prompt_tokens_total, ranks=page.ranks,
        admission_rejections=page.admission_rejections,
    )


def counter_increase(previous: float | None, current: float | None) -> float:
    """How much a counter grew between two readings; a drop means the engine restarted from zero."""
    if previous is None or current is None:
        return 0.0
    if current >= previous:
        return current - previous
    return current


# -- the view ---------------------------------------------------------------------------------------
class EngineView:
    """The latest snapshot of the upstream engine, refreshed on a timer."""

    def __init__(
        self,
        fetch: Fetch,
        *,
        interval: float,
        stale_after: float,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._fetch = fetch
        self._stale_after = stale_after
        self._metrics = metrics
        self._clock = clock
        self.snapshot: EngineSnapshot = never_scraped(clock())
        self._last_ok_at: float | None = None
        self.failures = 0  # scrapes failed in a row
        self.last_failure: str | None = None  # why the latest failed scrape failed
        self._last_preemptions: float | None = None
        self._listeners: list[SnapshotListener] = []
        # refresh catches fetch errors itself; the timer's own guard is against bugs, so that it never dies.
        self._timer = Periodic(
            lambda: self.refresh(), interval, name="engine-view", failed="engine scrape crashed",
            logger=log, sleep=sleep,
        )
        self.queue_cap = QueueCap(clock)  # whether vLLM's own queue cap refuses requests now

    def on_snapshot(self, cb: SnapshotListener) -> None:
        self._listeners.append(cb)

    def age(self) -> float | None:
        """Seconds since the last successful scrape; None before the first."""
        return None if self._last_ok_at is None else max(0.0, self._clock() - self._last_ok_at)

    def is_stale(self) -> bool:
        age = self.age()
        return age is None or age > self._stale_after

    def answering(self) -> bool:
        """Whether the engine answers its scrapes: fewer than ``FAILED_SCRAPES_DOWN`` failed in a row."""
        return self.failures < FAILED_SCRAPES_DOWN

    def publish_freshness(self) -> None:
        """Export the age and staleness as of now. A scrape sets them when it ends, so one that hangs (an
        engine that accepts connections and never answers) would otherwise leave them frozen at "fresh"."""
        self._metrics.record_engine_freshness(self.age(), self.is_stale())

    async def refresh(self) -> EngineSnapshot:
        taken_at = self._clock()
        old = self.snapshot
        page: EngineMetrics | None = None
        try:
            status, body = await self._fetch(METRICS_PATH)
            if status == 200:
                page = parse_metrics(body.decode("utf-8", "replace"))
            else:
                log.debug("engine %s answered HTTP %d", METRICS_PATH, status)
                self.last_failure = f"HTTP {status}"
        except Exception as exc:
            log.debug("engine %s scrape failed: %r", METRICS_PATH, exc)
            self.last_failure = exc.message if isinstance(exc, GatewayError) else type(exc).__name__
        if page is None:
            new = replace(never_scraped(taken_at), num_gpu_blocks=old.num_gpu_blocks, block_size=old.block_size)
            self.failures += 1
        else:
            new = snapshot_of(taken_at, page)
            self._last_ok_at = taken_at
            self.failures = 0
        self.snapshot = new
        if new.preemptions_total is not None:
            self._metrics.record_preemptions(counter_increase(self._last_preemptions, new.preemptions_total))
            self._last_preemptions = new.preemptions_total
        self._metrics.record_scrape(new.ok, self.age(), self.is_stale())
        for cb in list(self._listeners):
            try:
                cb(old, new)
            except Exception:
                log.exception("engine snapshot listener failed")
        return new

    async def start(self) -> None:
        self._timer.start()

    async def stop(self) -> None:
        await self._timer.stop()
