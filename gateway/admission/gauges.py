"""The admission gauges that change with every request (committed blocks, sharing, queue depth), set when
``/metrics`` is read (``Admission.publish``), and then only those whose value changed."""

from __future__ import annotations

from collections.abc import Mapping

from gateway.admission.placement import Sites, total
from gateway.metrics import Metrics


class LoadGauges:
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._committed: int | None = None
        self._depth: dict[int, int] | None = None

    def publish(self, *, committed: int, logical: int, shared: int, depth: Mapping[int, int]) -> None:
        if committed != self._committed:
            self._metrics.kv_committed.set(committed)
            self._metrics.record_sharing(logical=logical, shared=shared)
            self._committed = committed
        if depth != self._depth:
            self._depth = dict(depth)
            self._metrics.record_queue_depth(self._depth)

    def publish_kv(self, sites: Sites) -> bool:
        """The KV gauges, every engine's together (and each engine's, when there are several); False while no
        capacity is known."""
        self._metrics.record_engines([
            (s.name, s.books.committed, s.budget(s.capacity()), len(s.in_flight), s.admitted_total) for s in sites
        ] if len(sites) > 1 else [])
        loads = sites.loads()
        if not loads:
            return False
        self._metrics.record_kv(
            capacity=sum(cap.blocks for cap, _, _, _ in loads), budget=sites.budget_total(),
            committed=sites.committed, live_used=total(live for _, live, _, _ in loads),
            admit_limit=sum(limit for _, _, _, limit in loads),
        )
        return True

    def publish_load(self, sites: Sites, depth: Mapping[int, int]) -> None:
        every = list(sites)
        self.publish(
            committed=sites.committed, logical=sum(s.books.logical for s in every),
            shared=sum(s.books.shared_held for s in every), depth=depth,
        )
