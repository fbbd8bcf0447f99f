"""The engine as the gateway sees it, for ``/health``, ``/guard/status`` and the live page: where it is (its
credentials redacted), its state (``hung`` when it makes no progress while work runs), its context length and
the gateway's limit on it, its model, its restarts; and the load an inference gateway's endpoint picker reads
from ``/metrics`` (docs/scale-out.md)."""

from __future__ import annotations

from typing import TypedDict

from gateway.engine.progress import ProgressStatus
from gateway.guard.parts import Parts
from gateway.guard.policy import effective_max_model_len
from gateway.managed.lifecycle import EngineLifecycle
from gateway.redact import redact_url

HUNG = "hung"  # an engine state of proxy mode: it answers /health but makes no progress


class UpstreamStatus(TypedDict):
    url: str
    state: str
    max_model_len: int | None
    effective_max_model_len: int | None
    model: str | None
    last_restart_reason: str | None
    restarts: int
    progress: ProgressStatus


def upstream_status(parts: Parts) -> UpstreamStatus:
    info = parts.models.cached
    sup = parts.supervisor
    state: str
    if sup is not None:
        state, restarts, reason, url = sup.state, sup.restarts, sup.last_restart_reason, sup.url
    else:
        fresh = info is not None and parts.engine.is_fresh()
        state = EngineLifecycle.READY if fresh else EngineLifecycle.DOWN
        if fresh and parts.engine.progress.hung:
            state = HUNG
        restarts, reason, url = 0, None, parts.settings.upstream
    engine_limit = info.max_model_len if info else None
    return {
        "url": redact_url(url),
        "state": str(state),
        "max_model_len": engine_limit,
        "effective_max_model_len": effective_max_model_len(engine_limit, parts.settings.max_model_len),
        "model": info.ids[0] if info and info.ids else None,
        "last_restart_reason": reason,
        "restarts": restarts,
        "progress": parts.engine.progress.status(),
    }


def publish_pool_metrics(parts: Parts) -> None:
    """What an endpoint picker reads, as of now: the queue is the engine's and the gateway's together (a
    request queued here waits as surely as one queued in vLLM), KV usage the larger of the engine's live usage
    and the gateway's reservations (blocks booked are promised even before the engine fills them)."""
    engine, admission = parts.engine, parts.admission
    snap = engine.snapshot
    fresh = engine.is_fresh()
    waiting = (snap.waiting or 0) if fresh else 0
    running = snap.running if fresh and snap.running is not None else admission.in_flight
    capacity = snap.num_gpu_blocks or parts.settings.kv_blocks
    booked = admission.committed / capacity if capacity else 0.0
    live = snap.kv_usage if fresh and snap.kv_usage is not None else 0.0
    parts.metrics.record_pool(
        queued=waiting + admission.queued, running=running, kv_usage=min(1.0, max(live, booked)),
        block_size=admission.block_size, num_gpu_blocks=capacity,
    )
