"""``Engine``: the one place the gateway's knowledge of one vLLM engine lives.

An engine is where it is (its URL), the one HTTP client that talks to it, the models it serves and their
context length, the live view of its metrics (the latest snapshot, hence its KV capacity and usage), whether
it makes progress while work runs (``progress``) and whether it says it is healthy (``health``). Whether it
takes new requests (``refusal``) is one judgement, which ``/health`` reports and admission follows.
Nothing here is global: several engines exist side by side, each with its own client and view. The KV ledger
booked against an engine is kept by the ``Admission`` built for it, one layer up (admission reads this
package, never the other way round).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from gateway.engine.client import Upstream
from gateway.engine.health import EngineHealth
from gateway.engine.live import FAILED_SCRAPES_DOWN, EngineSnapshot, EngineView
from gateway.engine.models import ServedModels
from gateway.engine.progress import ProgressDetector
from gateway.engine.queue_cap import QueueCap
from gateway.engine.usage import Fingerprint
from gateway.errors import GatewayError, UpstreamUnavailable

ModelsT = TypeVar("ModelsT", bound=ServedModels)
# Seconds a client refused because the engine is down waits before trying again: the scrapes and health checks
# tell within a second or two when it is back.
RETRY_AFTER_DOWN = 2.0


@dataclass(slots=True)
class Engine(Generic[ModelsT]):
    """``models`` is the engine's served-models holder; the request path uses a subclass that also loads the
    model's tokenizer (``gateway.guard.models.Models``)."""

    client: Upstream
    models: ModelsT
    view: EngineView
    # Whether it makes progress while work runs (hung or not); judged only once started (proxy mode).
    progress: ProgressDetector = field(default_factory=ProgressDetector)
    # Whether vLLM's own queue cap refuses requests now: the view's, which admission reads (assembly.py).
    queue_cap: QueueCap = field(default_factory=QueueCap)
    # The system_fingerprint it stamps on the last chunks of streams that carry no usage, learned from its usage
    # chunks (``usage``): a server constant, so the relay stamps it as each choice ends instead of waiting.
    fingerprint: Fingerprint = field(default_factory=Fingerprint)
    # Whether it says it is healthy (its own /health); asked only once started (proxy mode).
    health: EngineHealth = field(default_factory=EngineHealth)

    @property
    def url(self) -> str:
        return self.client.base_url

    @property
    def snapshot(self) -> EngineSnapshot:
        return self.view.snapshot

    @property
    def answers(self) -> int:
        """Answers completed through the gateway: progress for the managed watchdog as for the hang detector."""
        return self.progress.answers

    @property
    def max_model_len(self) -> int | None:
        """The engine's own context length, from its model listing; None until it has been read."""
        listing = self.models.cached
        return listing.max_model_len if listing is not None else None

    def serves_like(self, first: Engine[ModelsT]) -> bool:
        """Whether it serves what ``first`` serves (the models and their context length), as far as both listings
        are known: an engine that came up later with another model must take nothing."""
        mine, theirs = self.models.cached, first.models.cached
        if mine is None or theirs is None:
            return True
        return (mine.ids, mine.max_model_len) == (theirs.ids, theirs.max_model_len)

    def usable(self) -> bool:
        """Whether requests may be placed on it now (``refusal``)."""
        return self.refusal() is None

    def down(self) -> bool:
        """It does not answer its scrapes (``live.EngineView.answering``), or its own ``/health`` says 5xx."""
        return not self.view.answering() or self.health.unhealthy

    def refusal(self) -> GatewayError | None:
        """Why it takes no new request now (down, or hung: what ``/health`` says of it), as the refusal a request
        gets when no engine takes it; None when it takes requests. Stale metrics alone are no reason: a busy
        host's late loop ages every snapshot while the engine is fine (admission then trusts its books alone)."""
        if not self.view.answering():
            return UpstreamUnavailable(
                f"The engine does not answer: its last {FAILED_SCRAPES_DOWN} scrapes of /metrics failed "
                f"({self.view.last_failure}); retry shortly.", retry_after=RETRY_AFTER_DOWN,
            )
        if self.health.unhealthy:
            return UpstreamUnavailable(
                f"The engine says it is unhealthy: its /health answered HTTP {self.health.status}; retry shortly.",
                retry_after=RETRY_AFTER_DOWN,
            )
        return self.progress.error() if self.progress.hung else None

    def is_fresh(self) -> bool:
        """Its latest scrape succeeded and is recent."""
        return self.view.snapshot.ok and not self.view.is_stale()
