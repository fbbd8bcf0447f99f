"""The engine as the gateway sees it, for ``/health``, ``/guard/status`` and the live page: where it is (its
credentials redacted), its state, its context length and the gateway's limit on it, its model, its restarts."""

from __future__ import annotations

from typing import TypedDict

from gateway.guard.parts import Parts
from gateway.guard.policy import effective_max_model_len
from gateway.managed.lifecycle import EngineLifecycle
from gateway.redact import redact_url


class UpstreamStatus(TypedDict):
    url: str
    state: str
    max_model_len: int | None
    effective_max_model_len: int | None
    model: str | None
    last_restart_reason: str | None
    restarts: int


def upstream_status(parts: Parts) -> UpstreamStatus:
    info = parts.models.cached
    sup = parts.supervisor
    if sup is not None:
        state, restarts, reason, url = sup.state, sup.restarts, sup.last_restart_reason, sup.url
    else:
        fresh = info is not None and parts.engine.is_fresh()
        state = EngineLifecycle.READY if fresh else EngineLifecycle.DOWN
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
    }
