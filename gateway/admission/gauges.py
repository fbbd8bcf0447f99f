"""The admission gauges that change with every request (committed blocks, sharing, queue depth), set only when
their value changed: they are published on every admission and release."""

from __future__ import annotations

from collections.abc import Mapping

from gateway.metrics import Metrics


class LoadGauges:
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._committed: int | None = None
        self._depth: dict[int, int] | None = None

    def committed_set(self, committed: int) -> None:
        """Note a committed total published elsewhere (with the other KV gauges)."""
        self._committed = committed

    def publish(self, *, committed: int, logical: int, shared: int, depth: Mapping[int, int]) -> None:
        if committed != self._committed:
            self._metrics.kv_committed.set(committed)
            self._metrics.record_sharing(logical=logical, shared=shared)
            self._committed = committed
        if depth != self._depth:
            self._depth = dict(depth)
            self._metrics.record_queue_depth(self._depth)
