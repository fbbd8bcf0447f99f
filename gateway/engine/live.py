"""The upstream view: scrapes vLLM's ``/metrics`` and ``/v1/models`` into immutable, timestamped snapshots.

Admission reads live KV usage and preemptions from here; capacity comes from ``vllm:cache_config_info``.
Scraping is async on a timer; a failed scrape produces a snapshot with ``ok=False`` that keeps the
engine's static facts (capacity, context length, model) so that a short outage does not forget them,
while the live fields are ``None``. Whoever reads live fields must check :meth:`EngineView.is_stale`.

With data parallelism vLLM publishes one ``cache_config_info`` series per engine; the view reports one
engine's capacity and the highest usage among engines, which is conservative for a gateway that cannot
tell which engine a request lands on.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import orjson

from gateway.metrics import Metrics

log = logging.getLogger(__name__)

Fetch = Callable[[str], Awaitable[tuple[int, bytes]]]
SnapshotListener = Callable[["EngineSnapshot", "EngineSnapshot"], None]

METRICS_PATH = "/metrics"
MODELS_PATH = "/v1/models"

# One sample line of the Prometheus text format: name, optional {labels}, value, optional timestamp.
_SAMPLE = re.compile(
    r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+-?\d+)?\s*$"
)
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')

# Series names: V1 first, then the V0 / pre-0.12 spelling kept as a fallback.
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_PREEMPTIONS = "vllm:num_preemptions_total"
_GENERATION = "vllm:generation_tokens_total"
_CACHE_INFO = "vllm:cache_config_info"


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
    max_model_len: int | None
    model_id: str | None
    model_root: str | None


def never_scraped(at: float) -> EngineSnapshot:
    return EngineSnapshot(
        taken_at=at, ok=False, has_metrics=False, kv_usage=None, running=None, waiting=None,
        preemptions_total=None, generation_tokens_total=None, num_gpu_blocks=None, block_size=None,
        max_model_len=None, model_id=None, model_root=None,
    )


def counter_increase(previous: float | None, current: float | None) -> float:
    """How much a counter grew between two readings; a drop means the engine restarted from zero."""
    if previous is None or current is None:
        return 0.0
    if current >= previous:
        return current - previous
    return current


# -- parsing ----------------------------------------------------------------------------------------
def _parse_labels(raw: str | None) -> dict[str, str]:
    if not raw:
        return {}
    return {k: v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\") for k, v in _LABEL.findall(raw)}


def _int_label(labels: dict[str, str], key: str) -> int | None:
    raw = labels.get(key)
    if raw is None:
        return None
    try:
        value = int(float(raw))
    except ValueError:
        return None  # vLLM writes "None" before the cache is sized
    return value if value > 0 else None


def parse_vllm_metrics(text: str) -> dict[str, Any]:
    """Read the series admission needs from vLLM's Prometheus text.

    Returns the keys ``has_metrics``, ``kv_usage``, ``running``, ``waiting``, ``preemptions_total``,
    ``generation_tokens_total``, ``num_gpu_blocks``, ``block_size`` (each ``None`` when absent).
    Counts are summed over label sets (engines, models); KV usage is the highest one. Lines that do not
    parse are skipped, so a partial or garbled page yields what it can.
    """
    sums: dict[str, float] = {}
    usage: dict[str, float] = {}
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    has_metrics = False
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("vllm:"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m["value"])
        except ValueError:
            continue
        name = m["name"]
        has_metrics = True
        if math.isnan(value) or math.isinf(value):
            continue
        if name in _KV_USAGE:
            usage[name] = max(usage.get(name, 0.0), value)
        elif name in (_RUNNING, _WAITING, _PREEMPTIONS, _GENERATION):
            sums[name] = sums.get(name, 0.0) + value
        elif name == _CACHE_INFO and num_gpu_blocks is None:
            labels = _parse_labels(m["labels"])
            bs = _int_label(labels, "block_size")
            blocks = _int_label(labels, "num_gpu_blocks")
            tokens = _int_label(labels, "kv_cache_size_tokens")
            if blocks is None and bs is not None and tokens is not None:
                blocks = tokens // bs
            if bs is not None:
                block_size = bs
                num_gpu_blocks = blocks
    kv_usage = next((usage[n] for n in _KV_USAGE if n in usage), None)
    if kv_usage is not None:
        # vLLM reports a fraction; a few exporters scale it to percent.
        kv_usage = kv_usage / 100.0 if kv_usage > 1.0 else kv_usage
        kv_usage = min(1.0, max(0.0, kv_usage))

    def count(name: str) -> int | None:
        return round(sums[name]) if name in sums else None

    return {
        "has_metrics": has_metrics,
        "kv_usage": kv_usage,
        "running": count(_RUNNING),
        "waiting": count(_WAITING),
        "preemptions_total": sums.get(_PREEMPTIONS),
        "generation_tokens_total": sums.get(_GENERATION),
        "num_gpu_blocks": num_gpu_blocks,
        "block_size": block_size,
    }


def parse_models(body: bytes) -> dict[str, Any]:
    """``max_model_len``, ``model_id`` and ``model_root`` of the first model in a ``/v1/models`` answer."""
    out: dict[str, Any] = {"max_model_len": None, "model_id": None, "model_root": None}
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return out
    models = data.get("data") if isinstance(data, dict) else None
    if not isinstance(models, list) or not models or not isinstance(models[0], dict):
        return out
    first: dict[str, Any] = models[0]
    mml = first.get("max_model_len")
    if isinstance(mml, int) and not isinstance(mml, bool) and mml > 0:
        out["max_model_len"] = mml
    for key, field in (("id", "model_id"), ("root", "model_root")):
        value = first.get(key)
        if isinstance(value, str) and value:
            out[field] = value
    return out


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
        self._interval = interval
        self._stale_after = stale_after
        self._metrics = metrics
        self._clock = clock
        self._sleep = sleep
        self.snapshot: EngineSnapshot = never_scraped(clock())
        self._last_ok_at: float | None = None
        self._last_preemptions: float | None = None
        self._listeners: list[SnapshotListener] = []
        self._task: asyncio.Task[None] | None = None
        # /v1/models changes only when the engine restarts, which a failed scrape usually reveals.
        self._models_known = False

    def on_snapshot(self, cb: SnapshotListener) -> None:
        self._listeners.append(cb)

    def age(self) -> float | None:
        """Seconds since the last successful scrape; None before the first."""
        return None if self._last_ok_at is None else max(0.0, self._clock() - self._last_ok_at)

    def is_stale(self) -> bool:
        age = self.age()
        return age is None or age > self._stale_after

    def publish_freshness(self) -> None:
        """Export the age and staleness as of now. A scrape sets them when it ends, so one that hangs (an
        engine that accepts connections and never answers) would otherwise leave them frozen at "fresh"."""
        self._metrics.record_engine_freshness(self.age(), self.is_stale())

    async def refresh(self) -> EngineSnapshot:
        taken_at = self._clock()
        old = self.snapshot
        parsed: dict[str, Any] | None = None
        try:
            status, body = await self._fetch(METRICS_PATH)
            if status == 200:
                parsed = parse_vllm_metrics(body.decode("utf-8", "replace"))
            else:
                log.debug("engine %s answered HTTP %d", METRICS_PATH, status)
        except Exception as exc:
            log.debug("engine %s scrape failed: %r", METRICS_PATH, exc)
        models: dict[str, Any] | None = None
        if parsed is not None and not self._models_known:
            models = await self._fetch_models()
        if parsed is None:
            self._models_known = False
            new = replace(
                never_scraped(taken_at),
                num_gpu_blocks=old.num_gpu_blocks, block_size=old.block_size,
                max_model_len=old.max_model_len, model_id=old.model_id, model_root=old.model_root,
            )
        else:
            statics = models or {
                "max_model_len": old.max_model_len, "model_id": old.model_id, "model_root": old.model_root
            }
            new = EngineSnapshot(taken_at=taken_at, ok=True, **parsed, **statics)
            self._last_ok_at = taken_at
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

    async def _fetch_models(self) -> dict[str, Any] | None:
        try:
            status, body = await self._fetch(MODELS_PATH)
        except Exception as exc:
            log.debug("engine %s failed: %r", MODELS_PATH, exc)
            return None
        if status != 200:
            return None
        models = parse_models(body)
        self._models_known = models["max_model_len"] is not None
        return models

    async def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="engine-view")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:
                # refresh catches fetch errors itself; this guards against bugs so the timer never dies.
                log.exception("engine scrape crashed")
            await self._sleep(self._interval)
