"""One engine as admission books it: a vLLM server, or one data-parallel rank of one.

Each site has what admission knows of its engine alone: the KV capacity and live usage (``kv``), the books of the
blocks its requests hold (prefix-aware), what the adaptive policy learned from it (``projector``), its requests in
flight, and the prompts it finished lately (vLLM keeps freed blocks cached until they are needed again). The queue,
its deadlines and the tenants' shares are the controller's, across every site.

A data-parallel vLLM is one URL and several engines, each with its own KV cache; its metrics carry each engine's
series under an ``engine`` label (read in ``gateway/engine/vllm_api/metrics.py``). A rank's site reads only its
rank's figures (``RankView``), and its requests carry ``X-data-parallel-rank``, which vLLM's API server honours
instead of its own balancing (``vllm/entrypoints/generate/base/serving.py``, vLLM 0.32).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from gateway.admission.books import Books
from gateway.admission.destination import Destination
from gateway.admission.headroom import Claim
from gateway.admission.kv_view import KvView, SnapshotSource, foreign_sequences
from gateway.admission.ledger import Capacity
from gateway.admission.policy import Policy, Room
from gateway.admission.prefix import BlockKey, leading_run
from gateway.admission.projection import Projector
from gateway.admission.reservation import Reservation
from gateway.config import Settings
from gateway.engine.live import EngineSnapshot, EngineView
from gateway.engine.queue_cap import QueueCap

RECENT_KEYS = 4096  # block keys of finished prompts remembered per site: affinity, not accounting


class RankView:
    """An engine view narrowed to one data-parallel rank: its own capacity, usage and counts."""

    def __init__(self, view: EngineView, rank: str) -> None:
        self._view = view
        self.rank = rank
        self.queue_cap = view.queue_cap  # vLLM caps its queue per API server: every rank's together

    @property
    def snapshot(self) -> EngineSnapshot:
        return rank_snapshot(self._view.snapshot, self.rank)

    def is_stale(self) -> bool:
        return self._view.is_stale()

    def age(self) -> float | None:
        return self._view.age()

    def publish_freshness(self) -> None:
        self._view.publish_freshness()


def rank_snapshot(snap: EngineSnapshot, rank: str) -> EngineSnapshot:
    """``snap`` as one rank sees it: its usage, counts and blocks; the engine's where the rank says nothing."""
    r = snap.ranks.get(rank)
    if r is None:
        return replace(snap, kv_usage=None, running=None, waiting=None, preemptions_total=None, ranks={})
    return replace(
        snap, kv_usage=r.kv_usage, running=r.running, waiting=r.waiting, preemptions_total=r.preemptions_total,
        generation_tokens_total=r.generation_tokens_total, num_gpu_blocks=r.num_gpu_blocks or snap.num_gpu_blocks,
        ranks={},
    )


class SiteHeadroom:
    """The tenants' headroom, kept over every site's budget together, split among the sites by their budgets:
    one site keeps its part of the room the other active tenants are owed across the pool."""

    def __init__(self, headroom: Room, pool_budget: Callable[[], int]) -> None:
        self._headroom = headroom
        self._pool_budget = pool_budget  # the sites' budgets together

    def reserved(self, r: Claim, budget: int) -> int:
        total = max(budget, self._pool_budget())
        room = self._headroom.reserved(r, total)
        return room if total == budget else math.ceil(room * budget / total)


class RecentPrefixes:
    """Block keys of the prompts a site finished lately, least recent forgotten first: vLLM keeps a finished
    request's blocks cached until it needs them again, so a prompt that shares them is cheaper there."""

    def __init__(self, size: int = RECENT_KEYS) -> None:
        self._keys: OrderedDict[BlockKey, None] = OrderedDict()
        self._size = size

    def add(self, keys: Sequence[BlockKey]) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self._size:
            self._keys.popitem(last=False)

    def prefix(self, keys: Sequence[BlockKey]) -> int:
        """How many of ``keys``, from the first, were seen lately (a chain: a key implies its predecessors)."""
        return leading_run(keys, self._keys)


class Site:
    """One engine's books and what admission learned of it."""

    def __init__(
        self, target: Destination, view: SnapshotSource | None, settings: Settings, headroom: Room
    ) -> None:
        self.target = target
        # vLLM's own queue cap refused a request here lately: full until it has room (engine/queue_cap.py)
        self.queue_cap: QueueCap | None = getattr(view, "queue_cap", None)
        self.kv = KvView(view, settings)
        self.books = Books()
        self.projector = Projector(
            credit_window=2 * settings.scrape_interval, budget=settings.preemption_budget, kv_target=settings.kv_target,
        )
        self.policy = Policy(settings, self.kv, self.books, self.projector, headroom)
        self.in_flight: set[Reservation] = set()
        self.recent = RecentPrefixes()
        self.foreign = 0  # sequences the engine runs or queues beyond the gateway's, at the last snapshot
        self.engine_queued = False  # its engine had requests of its own waiting, at the last snapshot
        self.admitted_total = 0

    @property
    def name(self) -> str:
        return self.target.name

    def capacity(self) -> Capacity | None:
        return self.kv.capacity()

    def budget(self, cap: Capacity | None) -> int | None:
        return self.kv.budget(cap) if cap is not None else None

    def free_blocks(self) -> int:
        """Budget left over the books (or minus the requests in flight while the capacity is unknown)."""
        cap = self.capacity()
        return self.kv.budget(cap) - self.books.committed if cap is not None else -len(self.in_flight)

    def affinity(self, r: Reservation) -> int:
        """Prompt blocks of ``r`` this engine holds or lately held: the prefill it would skip here."""
        if not r.keys:
            return 0
        return max(self.books.held_prefix(r.keys), self.recent.prefix(r.keys))

    def fits(self, r: Reservation) -> bool:
        if self.queue_cap is not None and self.queue_cap.full:
            return False
        cap = self.capacity()
        budget = self.kv.budget(cap) if cap is not None else 0
        return self.policy.fits(r, cap, budget, self.in_flight)

    def observe(self, snap: EngineSnapshot) -> EngineSnapshot:
        """The site's view of an engine-wide snapshot (its rank's, on a data-parallel engine)."""
        return rank_snapshot(snap, str(self.target.rank)) if self.target.rank is not None else snap

    def learn(
        self, old: EngineSnapshot, new: EngineSnapshot, held_back: bool = False, compute_room: bool = True
    ) -> float:
        """A new snapshot of the engine: foreign traffic, and preemptions; returns those not blamed on us.
        ``held_back``: requests wait in the gateway's queue; ``compute_room``: the engine's steps leave time for
        more within the TTFT objective."""
        old, new = self.observe(old), self.observe(new)
        self.foreign = foreign_sequences(new, self.in_flight)
        self.engine_queued = bool(new.waiting)
        return self.projector.observe(
            old, new, self.in_flight, foreign=self.foreign > 0, held_back=held_back, compute_room=compute_room
        )

    def status(self, mode: str, sharing: bool) -> dict[str, Any]:
        cap = self.capacity()
        budget = self.budget(cap)
        engine = self.kv.engine_status()
        return {
            "name": self.name,
            "engine": self.target.engine,
            "rank": self.target.rank,
            "capacity_blocks": cap.blocks if cap else None,
            "budget_blocks": budget,
            "committed_blocks": self.books.committed,
            "live_used_blocks": self.kv.live_used(cap),
            "in_flight": len(self.in_flight),
            "admitted_total": self.admitted_total,
            "foreign_sequences": self.foreign,
            "optimism": round(self.projector.optimism.value, 4),
            "prefix_sharing": self.books.status(mode, sharing),
            "kv_usage": engine["kv_usage"] if engine else None,
            "running": engine["running"] if engine else None,
            "waiting": engine["waiting"] if engine else None,
        }
