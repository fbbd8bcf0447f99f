"""What every stage of the request path shares: the gateway's parts, and what it did to one request."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gateway.admission.controller import Admission
from gateway.config import Settings
from gateway.engine.engine import Engine
from gateway.guard.models import Models
from gateway.guard.seams import AccessLogging, Admitting, Held, TenantLimits
from gateway.metrics import Metrics
from gateway.observe.access_log import AccessLog
from gateway.observe.history import Sampler
from gateway.observe.tracing import NoTracing, Tracing
from gateway.tenants import Tenants

if TYPE_CHECKING:  # imported only in managed mode: it loads the GPU and process tooling
    from gateway.managed.rolling import RollingRestarts
    from gateway.managed.supervisor import Supervisor


@dataclass(slots=True)
class Parts:
    """The gateway's parts: the engine it guards, the admission that books its KV blocks, and, in managed
    mode, the supervisor that runs it."""

    settings: Settings
    metrics: Metrics
    engine: Engine[Models]
    admission: Admitting  # the KV books: this process's, or the authority's (a worker)
    supervisor: Supervisor | None = None  # managed mode only
    sampler: Sampler | None = None  # the live page's history (/guard/ui)
    tenants: TenantLimits | None = None  # keys -> tenants, their limits and usage
    engines: list[Engine[Models]] = field(default_factory=list)  # every engine guarded; the first is ``engine``
    # Managed mode with several engines: one supervisor per engine (the first is ``supervisor``), restarts rolling.
    supervisors: list[Supervisor] = field(default_factory=list)
    rolling: RollingRestarts | None = None  # managed mode: restarts asked for or scheduled
    tracing: Tracing = field(default_factory=NoTracing)  # requests' traces (--otlp-traces-endpoint; no-op without)
    access_log: AccessLogging = field(init=False)  # one line per guarded request (--access-log)
    # With --workers: the other worker processes' metric families, gathered when /metrics is read.
    worker_metrics: Callable[[], Awaitable[list[Any]]] | None = None
    authority: Any = None  # with --workers: the admission authority's channel to its workers (its status)

    def __post_init__(self) -> None:
        self.access_log = AccessLog(self.settings.access_log)

    def local_admission(self) -> Admission:
        """The KV books themselves, for what only the process that keeps them reads (its status and gauges, the
        authority's side of ``--workers``): a worker's ``admission`` is the authority's, asked over its channel."""
        if not isinstance(self.admission, Admission):
            raise TypeError(f"this process keeps no KV books: its admission is a {type(self.admission).__name__}")
        return self.admission

    def local_tenants(self) -> Tenants | None:
        """The tenants' windows themselves (None without tenants), for what only the process that keeps them reads:
        a worker's ``tenants`` charge the authority's."""
        if self.tenants is not None and not isinstance(self.tenants, Tenants):
            raise TypeError(f"this process keeps no tenants' windows: its tenants are a {type(self.tenants).__name__}")
        return self.tenants

    def engine_at(self, index: int) -> Engine[Models]:
        """The engine a reservation was placed on (``Destination.engine``)."""
        return self.engines[index] if self.engines else self.engine

    def every_engine(self) -> list[Engine[Models]]:
        return self.engines or [self.engine]

    def every_supervisor(self) -> list[Supervisor]:
        """Managed mode: each engine's supervisor, in the engines' order; none in proxy mode."""
        return self.supervisors or ([self.supervisor] if self.supervisor is not None else [])

    def supervisor_at(self, index: int) -> Supervisor | None:
        sups = self.every_supervisor()
        return sups[index] if index < len(sups) else None

    def serving_engine(self) -> Engine[Models]:
        """The engine for what is not booked (the model listing, pass-through routes): the first usable one."""
        return next((e for e in self.engines if e.usable()), self.engine)

    @property
    def models(self) -> Models:
        return self.engine.models


@dataclass(slots=True)
class Outcome:
    """What the gateway did to a request, reported in x-guard-* headers."""

    request_id: str
    prompt_tokens: int = 0
    max_tokens: int = 0
    truncated_tokens: int = 0
    queue_ms: float = 0.0
    ratelimit: dict[str, str] | None = None  # the tenant's x-ratelimit-* headers, when it has per-minute limits
    engine: str | None = None  # the engine it ran on, when the gateway guards several (or a data-parallel one)
    # The reservation that learns what the engine generated: read live, since a stream's pipeline may be closed
    # after the stream's end was written (None: the request generates nothing, or never reached the engine).
    output: Held | None = None

    @property
    def completion_tokens(self) -> int | None:
        """Tokens generated, as the engine counts them (its usage figures, streamed answers included)."""
        return self.output.generated if self.output is not None else None

    def headers(self) -> dict[str, str]:
        h = {
            "x-request-id": self.request_id,
            "x-guard-prompt-tokens": str(self.prompt_tokens),
            "x-guard-max-tokens": str(self.max_tokens),
            "x-guard-queue-ms": f"{self.queue_ms:.1f}",
        }
        if self.truncated_tokens:
            h["x-guard-truncated-tokens"] = str(self.truncated_tokens)
        if self.ratelimit:
            h.update(self.ratelimit)
        if self.engine is not None:
            h["x-guard-engine"] = self.engine
        return h

