"""The engines admission places requests on (``Sites``), and which one a request tries first.

Each engine the gateway guards is a site; a data-parallel engine becomes one site per rank once its metrics show
the ranks (the ``engine`` label), as soon as nothing is in flight on it. A request goes to a site where it fits
now (the site's own policy and books), trying first the site that holds or lately held the longest prefix of its
prompt (vLLM would skip that prefill there), then the one with the most room left (``--placement headroom``: by
room alone). An engine that takes no new request (down, its own /health failing, or hung: ``usable``, the
judgement ``/health`` reports) takes nothing, even alone: the request path refuses new requests while no engine
takes them, and what was queued before waits for an engine to take it. With several sites, one that publishes
another block size or prefix-caching mode than the first takes nothing while another can. An engine held for
its restart takes nothing at all: its requests wait for another engine, or for it to come back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from gateway.admission.destination import Destination
from gateway.admission.headroom import Headroom
from gateway.admission.kv_view import KvView, SnapshotSource
from gateway.admission.ledger import Capacity
from gateway.admission.reservation import Reservation
from gateway.admission.site import RankView, Site, SiteHeadroom
from gateway.config import Settings
from gateway.engine.live import EngineSnapshot, EngineView

log = logging.getLogger(__name__)


def total(values: Iterable[int | None]) -> int | None:
    """The sum of the values known; None when none is."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def site_name(engine: int, rank: int | None) -> str:
    return str(engine) if rank is None else f"{engine}.{rank}"


class Sites:
    def __init__(
        self, settings: Settings, views: Sequence[EngineView | None], headroom: Headroom,
        usable: Callable[[int], bool] | None = None,
    ) -> None:
        self._settings = settings
        self._views = list(views) or [None]
        self._usable = usable if usable is not None else (lambda engine: True)
        self._headroom = SiteHeadroom(headroom, self.budget_total)
        self._sites = [self._site(i, None) for i in range(len(self._views))]
        self.held: set[int] = set()  # engines that take nothing new (draining for a restart), even alone
        # The whole first engine, for what status and the gauges say of the engine itself.
        self.engine_kv = KvView(self._views[0], settings)

    def __iter__(self) -> Iterator[Site]:
        return iter(self._sites)

    def __len__(self) -> int:
        return len(self._sites)

    @property
    def primary(self) -> Site:
        """The first engine's (first rank's) site: its block size and prefix caching are the pool's."""
        return self._sites[0]

    def of_engine(self, engine: int) -> list[Site]:
        return [s for s in self._sites if s.target.engine == engine]

    # -- totals ---------------------------------------------------------------------------------------
    @property
    def committed(self) -> int:
        return sum(s.books.committed for s in self._sites)

    def capacities(self) -> list[tuple[Site, Capacity]]:
        return [(s, cap) for s in self._sites if (cap := s.capacity()) is not None]

    def budget_total(self) -> int:
        return sum(s.kv.budget(cap) for s, cap in self.capacities())

    def largest(self) -> tuple[Capacity, int] | None:
        """The largest site's capacity and budget: what one request can ever be given."""
        # A loop, not ``max`` over a list with a key: read twice on every arrival, that was 6,800 instructions
        # each (a list, its tuples and a lambda called from C, compiled).
        best: tuple[Capacity, int] | None = None
        for site in self._sites:
            cap = site.capacity()
            if cap is not None:
                budget = site.kv.budget(cap)
                if best is None or budget > best[1]:  # the first of equals, as ``max``
                    best = (cap, budget)
        return best

    def loads(self) -> list[tuple[Capacity, int | None, int | None, int]]:
        """Each site of known capacity: its capacity, live usage, projection and admit limit (blocks)."""
        loads = []
        for site, cap in self.capacities():
            budget = site.kv.budget(cap)
            projected = site.policy.projection(cap, site.in_flight)
            limit = site.policy.admit_limit(budget, projected)
            loads.append((cap, site.kv.live_used(cap), projected, budget if limit is None else limit))
        return loads

    # -- placement ------------------------------------------------------------------------------------
    def candidates(self, r: Reservation, block_size: int, sharing: bool) -> list[Site]:
        """The sites ``r`` may go to, in the order to try them."""
        open_sites = [s for s in self._sites if s.target.engine not in self.held and self._usable(s.target.engine)]
        sites = [s for s in open_sites if s.name not in r.avoid] or open_sites
        if len(sites) <= 1:
            return sites
        usable = [s for s in sites if self._takes(s, block_size, sharing)] or sites
        if self._settings.placement == "headroom":
            return sorted(usable, key=lambda s: -s.free_blocks())
        return sorted(usable, key=lambda s: (-s.affinity(r), -s.free_blocks()))

    def _takes(self, site: Site, block_size: int, sharing: bool) -> bool:
        cap = site.capacity()
        return (cap is None or cap.block_size == block_size) and site.kv.prefix_sharing() == sharing

    # -- data-parallel ranks --------------------------------------------------------------------------
    def follow_ranks(self, engine: int, snap: EngineSnapshot) -> bool:
        """One site per rank of a data-parallel engine (one site again if it comes back without ranks), once
        nothing is in flight on its current sites; True when the sites changed."""
        if not snap.ok:
            return False  # a failed scrape says nothing of the ranks
        labels = sorted(snap.ranks) if len(snap.ranks) > 1 else []
        if not all(label.isdigit() for label in labels):
            return False
        want: list[int | None] = [*sorted(int(label) for label in labels)] or [None]
        mine = self.of_engine(engine)
        if [s.target.rank for s in mine] == want:
            return False
        if any(s.in_flight for s in mine):
            return False  # once they drain
        fresh = [self._site(engine, rank) for rank in want]
        self._sites = sorted(
            [s for s in self._sites if s.target.engine != engine] + fresh,
            key=lambda s: (s.target.engine, -1 if s.target.rank is None else s.target.rank),
        )
        names = ", ".join(s.name for s in fresh)
        log.info("engine %d: admission books %s on its own (%d data-parallel ranks)", engine, names, len(labels))
        return True

    def _site(self, engine: int, rank: int | None) -> Site:
        view = self._views[engine]
        source: SnapshotSource | None = view if rank is None or view is None else RankView(view, str(rank))
        return Site(Destination(site_name(engine, rank), engine, rank), source, self._settings, self._headroom)

    # -- status ---------------------------------------------------------------------------------------
    def rows(self, mode: str, sharing: bool) -> list[dict[str, Any]]:
        return [s.status(mode, sharing) for s in self._sites]

    def sharing_status(self, mode: str, sharing: bool) -> dict[str, Any]:
        """The prefix-sharing part of ``/guard/status``, every site's books together."""
        rows = [s.books.status(mode, sharing) for s in self._sites]
        if len(rows) == 1:
            return rows[0]
        total = {key: sum(row[key] for row in rows) for key in (
            "logical_committed_blocks", "physical_committed_blocks", "shared_blocks_held", "shared_block_references",
        )}
        physical = total["physical_committed_blocks"]
        ratio = round(total["logical_committed_blocks"] / physical, 3) if physical else None
        return {"mode": mode, "on": sharing, **total, "sharing_ratio": ratio}
