"""``Engine``: the one place the gateway's knowledge of one vLLM engine lives.

An engine is where it is (its URL), the one HTTP client that talks to it, the models it serves and their
context length, the live view of its metrics (the latest snapshot, hence its KV capacity and usage), and
whether it makes progress while work runs (``progress``).
Nothing here is global: several engines exist side by side, each with its own client and view. The KV ledger
booked against an engine is kept by the ``Admission`` built for it, one layer up (admission reads this
package, never the other way round).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from gateway.engine.client import Upstream
from gateway.engine.live import EngineSnapshot, EngineView
from gateway.engine.models import ServedModels
from gateway.engine.progress import ProgressDetector
from gateway.engine.queue_cap import QueueCap
from gateway.engine.usage import Fingerprint

ModelsT = TypeVar("ModelsT", bound=ServedModels)


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
        """Whether requests may be placed on it now: its metrics are fresh and it is not hung."""
        return self.is_fresh() and not self.progress.hung

    def is_fresh(self) -> bool:
        """Its latest scrape succeeded and is recent."""
        return self.view.snapshot.ok and not self.view.is_stale()
