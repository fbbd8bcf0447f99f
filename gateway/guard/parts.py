"""What every stage of the request path shares: the gateway's parts, and what it did to one request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from gateway.admission.controller import Admission
from gateway.config import Settings
from gateway.engine.client import Upstream
from gateway.engine.live import EngineView
from gateway.guard.models import Models
from gateway.metrics import Metrics
from gateway.observe.history import Sampler


class EngineState(Protocol):
    """What the request path needs of a managed engine (the supervisor)."""

    state: str

    def retry_after(self) -> float: ...

    async def failure_noticed(self) -> bool: ...


@dataclass(slots=True)
class Parts:
    settings: Settings
    metrics: Metrics
    upstream: Upstream
    models: Models
    admission: Admission
    supervisor: EngineState | None = None
    engine: EngineView | None = None
    sampler: Sampler | None = None  # the live page's history (/guard/ui)


@dataclass(slots=True)
class Outcome:
    """What the gateway did to a request, reported in x-guard-* headers."""

    request_id: str
    prompt_tokens: int = 0
    max_tokens: int = 0
    truncated_tokens: int = 0
    queue_ms: float = 0.0

    def headers(self) -> dict[str, str]:
        h = {
            "x-request-id": self.request_id,
            "x-guard-prompt-tokens": str(self.prompt_tokens),
            "x-guard-max-tokens": str(self.max_tokens),
            "x-guard-queue-ms": f"{self.queue_ms:.1f}",
        }
        if self.truncated_tokens:
            h["x-guard-truncated-tokens"] = str(self.truncated_tokens)
        return h

