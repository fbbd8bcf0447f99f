"""KV capacity and live usage as admission reads them: from the engine's latest snapshot, else from the flags."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol, TypedDict

from gateway.admission.ledger import Capacity, budget_blocks, capacity_from
from gateway.config import Settings
from gateway.engine.live import EngineSnapshot


class RankStatus(TypedDict):
    """One data-parallel engine's part of ``/guard/status``."""

    kv_usage: float | None
    running: int | None
    waiting: int | None
    preemptions_total: float | None
    capacity_blocks: int | None


class EngineStatus(TypedDict):
    """The engine's part of ``/guard/status``; ``ranks`` lists each engine of a data-parallel deployment."""

    ok: bool
    has_metrics: bool
    stale: bool
    age_s: float | None
    kv_usage: float | None
    running: int | None
    waiting: int | None
    preemptions_total: float | None
    ranks: dict[str, RankStatus]


class SnapshotSource(Protocol):
    """An engine's view (``EngineView``), or one data-parallel rank's (``site.RankView``)."""

    @property
    def snapshot(self) -> EngineSnapshot: ...

    def is_stale(self) -> bool: ...

    def age(self) -> float | None: ...

    def publish_freshness(self) -> None: ...


_NOTHING = object()


class KvView:
    """What the engine (or, without one, the flags) says about KV blocks right now."""

    def __init__(self, engine: SnapshotSource | None, settings: Settings) -> None:
        self._engine = engine
        self._settings = settings
        self._watermark = settings.watermark()
        # The capacity of the last snapshot read, and the budget of the last capacity: both change only with a
        # new snapshot, and admission asks for them several times a request (a frozen dataclass built each time
        # was ~10% of admission's CPU).
        self._cap_of: tuple[object, Capacity | None] = (_NOTHING, None)
        self._budget_of: tuple[Capacity | None, int] = (None, 0)

    def capacity(self) -> Capacity | None:
        snapshot = self._engine.snapshot if self._engine else None
        seen, cap = self._cap_of
        if seen is not snapshot:
            cap = capacity_from(snapshot, self._settings)
            self._cap_of = (snapshot, cap)
        return cap

    def budget(self, cap: Capacity) -> int:
        seen, budget = self._budget_of
        if seen is not cap:
            budget = budget_blocks(cap, self._settings.kv_target)
            self._budget_of = (cap, budget)
        return budget

    def watermark_blocks(self, cap: Capacity) -> int:
        """The blocks the engine keeps free when it admits a request beside running ones (vLLM's ``--watermark``:
        ``int(watermark x num_blocks)`` in ``KVCacheManager``, rounded up here, a block of margin at most)."""
        return math.ceil(self._watermark * cap.blocks - 1e-9) if self._watermark else 0

    def live_usable(self) -> bool:
        """Whether the engine's usage figures are fresh enough to admit on."""
        if self._engine is None or self._engine.is_stale():
            return False
        snap = self._engine.snapshot
        return snap.ok and snap.has_metrics and snap.kv_usage is not None

    def live_used(self, cap: Capacity | None) -> int | None:
        """Blocks the engine holds now, prefix sharing included; None when unknown."""
        if cap is None or self._engine is None:
            return None
        usage = self._engine.snapshot.kv_usage
        return None if usage is None else math.ceil(usage * cap.blocks - 1e-9)

    def engine_sequences(self) -> tuple[int, float] | None:
        """The sequences the engine runs or queues (``vllm:num_requests_running`` and ``_waiting``) and when that
        was read; None when unknown."""
        if self._engine is None:
            return None
        snap = self._engine.snapshot
        if not (snap.ok and snap.has_metrics) or snap.running is None:
            return None
        return snap.running + (snap.waiting or 0), snap.taken_at

    def prefix_sharing(self) -> bool:
        """Whether to book shared prompt blocks once: ``--prefix-sharing on|off``, or with ``auto`` whether the
        engine says prefix caching is on (``enable_prefix_caching`` of ``vllm:cache_config_info``)."""
        mode = self._settings.prefix_sharing
        if mode != "auto":
            return mode == "on"
        return self._engine is not None and self._engine.snapshot.prefix_caching is True

    def engine_status(self) -> EngineStatus | None:
        if self._engine is None:
            return None
        snap = self._engine.snapshot
        return EngineStatus(
            ok=snap.ok, has_metrics=snap.has_metrics, stale=self._engine.is_stale(), age_s=self._engine.age(),
            kv_usage=snap.kv_usage, running=snap.running, waiting=snap.waiting,
            preemptions_total=snap.preemptions_total,
            ranks={
                rank: RankStatus(
                    kv_usage=r.kv_usage, running=r.running, waiting=r.waiting,
                    preemptions_total=r.preemptions_total, capacity_blocks=r.num_gpu_blocks,
                )
                for rank, r in snap.ranks.items()
            } if len(snap.ranks) > 1 else {},
        )

    def publish_freshness(self) -> None:
        if self._engine is not None:
            self._engine.publish_freshness()


class InFlight(Protocol):
    @property
    def n(self) -> int: ...


def foreign_sequences(snapshot: EngineSnapshot, in_flight: Iterable[InFlight]) -> int:
    """Sequences the engine runs or queues beyond the gateway's own: traffic that does not come through it.

    vLLM counts each of a request's ``n`` sequences (and each prompt of a batch) as a request of its own. The
    gateway's requests admitted but not yet at the engine make this an underestimate, never an overestimate."""
    if not (snapshot.ok and snapshot.has_metrics) or snapshot.running is None:
        return 0
    engine = snapshot.running + (snapshot.waiting or 0)
    return max(0, engine - sum(r.n for r in in_flight))
