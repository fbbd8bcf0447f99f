"""The engine as the gateway sees it, for ``/health``, ``/guard/status`` and the live page: where it is (its
credentials redacted), its state (``hung`` when it makes no progress while work runs), its context length and
the gateway's limit on it, its model, its restarts; and the load an inference gateway's endpoint picker reads
from ``/metrics`` (docs/scale-out.md)."""

from __future__ import annotations

from typing import Any, TypedDict

from gateway.engine.engine import Engine
from gateway.engine.live import EngineSnapshot
from gateway.engine.progress import ProgressStatus
from gateway.guard.models import Models
from gateway.guard.parts import Parts
from gateway.guard.policy import effective_max_model_len
from gateway.managed.lifecycle import EngineLifecycle
from gateway.redact import redact_url

HUNG = "hung"  # an engine state of proxy mode: it answers /health but makes no progress
MISMATCHED = "mismatched"  # another engine than the first that serves another model or context length


class UpstreamStatus(TypedDict):
    url: str
    state: str
    max_model_len: int | None
    effective_max_model_len: int | None
    model: str | None
    last_restart_reason: str | None
    restarts: int
    progress: ProgressStatus


def engine_state(engine: Engine[Models]) -> str:
    """A proxied engine's state: ready, down (no model listing yet, its scrapes failing, or its own /health
    answering 5xx) or hung; admission follows the same judgement (``Engine.refusal``)."""
    if engine.models.cached is None or engine.down():
        return str(EngineLifecycle.DOWN)
    return HUNG if engine.progress.hung else str(EngineLifecycle.READY)


def engine_state_of(parts: Parts, index: int) -> str:
    """Engine ``index``'s state: its supervisor's in managed mode, else as proxied; mismatched before either."""
    engine = parts.engine_at(index)
    if not engine.serves_like(parts.engine):
        return MISMATCHED
    sup = parts.supervisor_at(index)
    return str(sup.state) if sup is not None else engine_state(engine)


def engines_status(parts: Parts, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Admission's rows for each engine (``/guard/status.engines``), with where each is and its state."""
    out = []
    for row in rows:
        engine = parts.engine_at(row["engine"])
        state = engine_state_of(parts, row["engine"])
        out.append({
            **row, "url": redact_url(engine.url), "state": state, "hung": engine.progress.hung,
            "queue_cap": queue_cap_status(engine),
        })
    return out


def queue_cap_status(engine: Engine[Models]) -> dict[str, object]:
    """vLLM's own queue cap on this engine: whether admission holds it as full now, the gateway's requests it
    refused, and the refusals vLLM counts itself (``vllm:admission_rejections_total`` by reason, every client's)."""
    return {**engine.queue_cap.status(), "engine_rejections_total": dict(engine.snapshot.admission_rejections)}


def upstream_status(parts: Parts) -> UpstreamStatus:
    info = parts.models.cached
    sup = parts.supervisor
    state: str
    if sup is not None:
        state, restarts, reason, url = sup.state, sup.restarts, sup.last_restart_reason, sup.url
        if len(sups := parts.every_supervisor()) > 1:
            # Several managed engines: the gateway serves while any one does; their restarts together.
            state = next((s.state for s in sups if s.state is EngineLifecycle.READY), state)
            restarts = sum(s.restarts for s in sups)
    else:
        state = engine_state(parts.engine)
        if len(parts.every_engine()) > 1 and state != EngineLifecycle.READY:
            # Several engines: the gateway serves while any one does (each engine's state: /guard/status).
            state = next((s for s in map(engine_state, parts.every_engine()) if s == EngineLifecycle.READY), state)
        restarts, reason, url = 0, None, parts.engine.url
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
    and the gateway's reservations (blocks booked are promised even before the engine fills them). Several
    engines behind one guard are one model server to the picker: their figures together."""
    admission = parts.local_admission()
    engines = parts.every_engine()
    snaps = [e.snapshot for e in engines if e.is_fresh()]
    waiting = sum(s.waiting or 0 for s in snaps)
    known = len(snaps) == len(engines) and all(s.running is not None for s in snaps)
    running = sum(s.running or 0 for s in snaps) if known else admission.in_flight
    sizes = [engine_blocks(e.snapshot)[0] or parts.settings.kv_blocks or 0 for e in engines]
    capacity = sum(sizes) or None
    booked = admission.committed / capacity if capacity else 0.0
    used = sum(engine_blocks(e.snapshot)[1] * size for e, size in zip(engines, sizes, strict=True) if e.is_fresh())
    live = used / capacity if capacity else 0.0
    parts.metrics.record_pool(
        queued=waiting + admission.queued, running=running, kv_usage=min(1.0, max(live, booked)),
        block_size=admission.block_size, num_gpu_blocks=capacity,
    )
    if len(engines) > 1:
        parts.metrics.record_engine_states({str(i): engine_state_of(parts, i) for i in range(len(engines))})
        # As /health says: ready while any engine is (each engine's own state is the gauge above).
        parts.metrics.set_upstream_state(upstream_status(parts)["state"])


def engine_blocks(snap: EngineSnapshot) -> tuple[int | None, float]:
    """An engine's KV blocks and the fraction in use, every data-parallel rank's together (each rank has a cache
    of its own; the engine-wide ``num_gpu_blocks`` is one rank's)."""
    ranks = [r for r in snap.ranks.values() if r.num_gpu_blocks] if len(snap.ranks) > 1 else []
    if not ranks:
        return snap.num_gpu_blocks, snap.kv_usage or 0.0
    blocks = sum(r.num_gpu_blocks or 0 for r in ranks)
    return blocks, sum((r.kv_usage or 0.0) * (r.num_gpu_blocks or 0) for r in ranks) / blocks
