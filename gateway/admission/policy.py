"""The admission policy: whether one more request fits now.

``strict`` admits while the books (``committed + need``) stay within the budget, or, with ``--time-aware on``,
the peak of the usage as the requests in flight end in turn does (``timeline``). ``adaptive`` admits whenever
strict would and, while the engine's metrics are fresh, as far as the projected usage of the admitted requests over
the tokens to come leaves room (``curve``). Beside requests in flight both keep the engine's watermark free
(``--engine-watermark``), as the engine itself does. Both honour ``--max-concurrency``, and leave the room other active
tenants keep (``headroom``). One pass over the queue computes the projection once and adds each admitted
request's curve to it."""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Protocol

from gateway.admission.books import Books
from gateway.admission.curve import UsageCurve, request_curve, usage_curve
from gateway.admission.headroom import Claim, Headroom
from gateway.admission.kv_view import KvView
from gateway.admission.ledger import Capacity
from gateway.admission.projection import Projector
from gateway.admission.reservation import Reservation
from gateway.admission.timeline import TimeAware
from gateway.config import Settings


class Room(Protocol):
    """The tenants' headroom as a policy asks it: the blocks admitting ``r`` must leave free out of ``budget``
    (``Headroom``, or a site's part of the pool's, ``site.SiteHeadroom``)."""

    def reserved(self, r: Claim, budget: int) -> int: ...


class Policy:
    def __init__(
        self, settings: Settings, kv: KvView, books: Books, projector: Projector, headroom: Room | None = None
    ) -> None:
        self._settings = settings
        self._headroom: Room = headroom if headroom is not None else Headroom(enabled=False)
        self._kv = kv
        self._books = books
        self._projector = projector
        self._projected: UsageCurve | None = None  # the projection while a pass over the queue needs it
        self.projections = 0  # projections computed: a pass over the queue computes one, or none
        self.time_aware = TimeAware(settings.time_aware == "on")  # the peak as requests end in turn (``timeline``)

    def begin_pass(self) -> None:
        """Forget the projection: the engine, the books or the requests in flight moved since the last pass."""
        self._projected = None
        self.time_aware.begin_pass()

    def fits(self, r: Reservation, cap: Capacity | None, budget: int, in_flight: Collection[Reservation]) -> bool:
        limit = self._settings.max_concurrency
        if limit is not None and len(in_flight) >= limit:
            return False
        if cap is None:
            return True
        self._books.quote(r)
        if in_flight:
            # The engine admits beside running requests only while its watermark stays free (vLLM's
            # ``--watermark``; a request alone may use it all): booked past it, a request would wait in vLLM's
            # own queue, where the gateway can neither order nor refuse it.
            budget -= self._kv.watermark_blocks(cap)
        if r.blocks > budget:
            return False
        budget -= self._headroom.reserved(r, budget)  # the room the other active tenants keep (``headroom``)
        if self._books.committed + r.blocks <= budget or self.time_aware.fits(r, in_flight, cap.block_size, budget):
            return True
        if not self._live():
            return False
        if self._projected is None:
            self._projected = self._curve(cap, in_flight)
        outlook = self._projector.outlook()
        extra = request_curve(r, cap.block_size, outlook)
        # The reach bets that the projected peak never comes (``budget``); a request that declares its whole
        # length (``ignore_eos``) surely brings its part of it, so it goes within the budget only.
        reach = 0.0 if r.min_output >= r.max_tokens else outlook.reach
        return self._projected is not None and self._projected.peak(extra) <= budget * (1.0 + reach)

    def admitted(self, r: Reservation, cap: Capacity | None) -> None:
        """Count ``r``'s curve into the projection of the pass under way."""
        self.time_aware.admitted(r)
        if self._projected is not None and cap is not None:
            self._projected.add(request_curve(r, cap.block_size, self._projector.outlook()))

    def projection(self, cap: Capacity | None, in_flight: Collection[Reservation]) -> int | None:
        """The peak of the adaptive projection as of now, in blocks; None where the policy does not use one."""
        curve = self._curve(cap, in_flight)
        return None if curve is None else math.ceil(curve.peak())

    def _curve(self, cap: Capacity | None, in_flight: Collection[Reservation]) -> UsageCurve | None:
        if cap is None or not self._live():
            return None
        live = self._kv.live_used(cap) or 0
        self.projections += 1
        return usage_curve(
            live, in_flight, cap.block_size, self._projector.outlook(), self._books.shared_held,
            engine=self._kv.engine_sequences(), transit=self._settings.scrape_interval,
        )

    def admit_limit(self, budget: int | None, projected: int | None) -> int | None:
        """The committed total the policy would accept now: the budget (and the reach past it), plus what live
        usage frees."""
        if budget is None:
            return None
        if projected is not None:
            reach = math.floor(budget * self._projector.optimism.reach)
            return budget + reach + max(0, self._books.committed - projected)
        return budget

    def _live(self) -> bool:
        return self._settings.admission_policy == "adaptive" and self._kv.live_usable()
