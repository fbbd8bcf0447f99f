"""What ``/guard/status`` shows of admission: one JSON document, read from the controller's parts, changing nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.admission.forecast import Forecast
from gateway.admission.headroom import Headroom
from gateway.admission.placement import Sites, total
from gateway.admission.queue import WaitQueue
from gateway.admission.reservation import Reservation
from gateway.config import Settings


@dataclass(frozen=True)
class Parts:
    """The controller's state a status document reads."""

    settings: Settings
    sites: Sites
    queue: WaitQueue[Reservation]
    forecast: Forecast
    headroom: Headroom
    block_size: int
    sharing: bool
    paused: bool
    in_flight: int
    drain_rate: float | None
    now: float
    deadlines: dict[str, float | bool | str | None]


def status_document(p: Parts) -> dict[str, Any]:
    s, sites, queue = p.settings, p.sites, p.queue
    known = sites.capacities()
    cap = known[0][1] if known else None
    budget = sites.budget_total() if known else None
    loads = sites.loads()
    primary = sites.primary
    mode = s.prefix_sharing
    return {
        "policy": s.admission_policy,
        "paused": p.paused,
        "held_engines": sorted(str(e) for e in sites.held),
        "block_size": p.block_size,
        "capacity_blocks": sum(c.blocks for _, c in known) if known else None,
        "capacity_source": cap.source if cap else None,
        "kv_target": s.kv_target,
        "budget_blocks": budget,
        "committed_blocks": sites.committed,
        "prefix_sharing": sites.sharing_status(mode, p.sharing),
        "foreign_sequences": sum(site.foreign for site in sites),
        "live_used_blocks": total(live for _, live, _, _ in loads),
        "projected_blocks": total(proj for _, _, proj, _ in loads),
        "time_aware": primary.policy.time_aware.status(primary.in_flight, queue.head(), p.block_size),
        "admit_limit_blocks": total(limit for _, _, _, limit in loads) if known else None,
        "in_flight": p.in_flight,
        "max_concurrency": s.max_concurrency,
        "queued": len(queue),
        "queued_by_priority": {str(pr): c for pr, c in sorted(queue.depth.items(), reverse=True)},
        "fair_queueing": queue.fair, "tenants": p.headroom.annotate(queue.tenants(), budget),
        "tenant_headroom": p.headroom.enabled,
        "max_queue": s.max_queue,
        "optimism": round(min(site.projector.optimism.value for site in sites), 4),
        "output_lengths": primary.projector.outputs.status(),
        "preemption_budget": primary.projector.optimism.status(p.now),
        "drain_rate_per_s": None if p.drain_rate is None else round(p.drain_rate, 3),
        "forecast": p.forecast.status(),
        "deadlines": p.deadlines,
        "engine": sites.engine_kv.engine_status(),
        "engines": sites.rows(mode, p.sharing),
    }
