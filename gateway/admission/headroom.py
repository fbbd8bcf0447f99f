"""Headroom for active tenants: the KV blocks a request must leave free for the other tenants sending now.

Fair queueing orders the queue; it cannot admit a quiet tenant's request while a flooding tenant holds the whole
budget, so that request waits for one of the flood's to end. The headroom keeps room for it instead. A tenant is
**active** while it has a request waiting or sent one within the last ``window`` seconds (30). Its **demand** is
the most blocks it held and asked for at once (admitted plus waiting) within that window. While two or more
tenants are active, a request of tenant T is admitted only if it leaves free, for each other active tenant U,
``min(demand(U), fair_share(U)) - held(U)`` blocks (none when U holds that already), where ``fair_share(U)`` is
U's weight over the active tenants' weights, times the budget.

It only admits less than the policy would without it, so strict's guarantee holds. It is work-conserving as far
as a reservation can be: a tenant alone is reserved nothing; a tenant that stops sending is reserved nothing once
the window has passed; and a tenant can always fill its own fair share, since the others' reservations are capped
at theirs. It never makes a request wait forever: the room kept for the others never exceeds what the budget has
beyond the request and what the others hold, so a request larger than its tenant's fair share goes once its own
tenant's other requests and the idle tenants' have ended, as the starvation bound lets the engine drain for it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypedDict

ACTIVE_WINDOW_S = 30.0  # how long a tenant that stopped sending is still reserved for


class Claim(Protocol):
    """What the headroom reads of a request."""

    @property
    def tenant(self) -> str: ...
    @property
    def weight(self) -> float: ...
    @property
    def blocks(self) -> int: ...


class TenantHeadroom(TypedDict):
    """One tenant's headroom as ``/guard/status`` shows it."""

    active: bool
    held_blocks: int
    demand_blocks: int
    headroom_blocks: int


@dataclass
class _Tenant:
    weight: float = 1.0
    last_arrival: float = -math.inf
    held: int = 0
    waiting: int = 0
    # (when it ended, level): the levels (held + waiting) the tenant left within the window, largest first, each
    # ending later than the one before it; a level that ended before a larger one is no peak of any later window.
    peaks: deque[tuple[float, int]] = field(default_factory=deque)

    @property
    def level(self) -> int:
        return self.held + self.waiting


class Headroom:
    """The tenants' holdings and recent demand, and the room a request must leave for the others.

    The controller tells it each request's arrival, leaving the queue, admission and release; the policy asks
    ``reserved`` for each request it considers. With ``enabled`` false it keeps count (``/guard/status`` shows
    it) but reserves nothing."""

    def __init__(
        self, *, enabled: bool, window: float = ACTIVE_WINDOW_S, clock: Callable[[], float] = time.monotonic,
        record: Callable[[str, int], None] | None = None,
    ) -> None:
        if window <= 0:
            raise ValueError(f"the active window must be above 0 seconds; got {window}")
        self._enabled = enabled
        self._window = window
        self._clock = clock
        self._record = record
        self._tenants: dict[str, _Tenant] = {}  # every tenant seen: bounded by the keys file's tenants
        self._waiting: dict[Claim, int] = {}  # the blocks each waiting request was counted with
        self._held: dict[Claim, int] = {}  # the blocks each admitted request was counted with

    @property
    def enabled(self) -> bool:
        return self._enabled

    # -- bookkeeping (the controller's) ------------------------------------------------------------
    def arrive(self, r: Claim) -> None:
        """``r`` starts waiting for admission: its tenant is active from now."""
        t = self._tenant(r.tenant)
        t.weight, t.last_arrival = r.weight, self._clock()
        self._waiting[r] = r.blocks
        self._move(t, waiting=r.blocks)

    def dequeued(self, r: Claim) -> None:
        """``r`` left the queue: admitted, refused, withdrawn or timed out."""
        blocks = self._waiting.pop(r, None)
        if blocks is not None:
            self._move(self._tenant(r.tenant), waiting=-blocks)

    def commit(self, r: Claim) -> None:
        """``r`` was admitted holding ``r.blocks``."""
        self._held[r] = r.blocks
        self._move(self._tenant(r.tenant), held=r.blocks)

    def release(self, r: Claim) -> None:
        """``r`` ended and gave its blocks back."""
        blocks = self._held.pop(r, None)
        if blocks is not None:
            self._move(self._tenant(r.tenant), held=-blocks)

    # -- the policy's question ---------------------------------------------------------------------
    def reserved(self, r: Claim, budget: int) -> int:
        """The blocks admitting ``r`` must leave free for the other active tenants, out of ``budget``."""
        if not self._enabled:
            return 0
        now = self._clock()
        active = self._active(now)
        others = [name for name in active if name != r.tenant]
        if not others:
            return 0
        weights = sum(self._tenants[name].weight for name in active) + (0.0 if r.tenant in active else r.weight)
        room = sum(self._room(self._tenants[name], budget, weights, now) for name in others)
        held_by_others = sum(self._tenants[name].held for name in others)
        # Never more than the budget has beyond ``r`` and what the others hold: else a request larger than its
        # tenant's fair share could wait for as long as the others keep sending.
        return max(0, min(room, budget - r.blocks - held_by_others))

    # -- what it shows -----------------------------------------------------------------------------
    def annotate(
        self, rows: Mapping[str, Mapping[str, object]], budget: int | None
    ) -> dict[str, dict[str, object]]:
        """``rows`` (``/guard/status``'s tenants) with each tenant's headroom added."""
        shown = self.status(budget)
        names = sorted(rows.keys() | shown.keys())
        return {name: {**rows.get(name, {}), **shown.get(name, _IDLE)} for name in names}

    def status(self, budget: int | None) -> dict[str, TenantHeadroom]:
        """Each tenant seen: whether it is active, what it holds, its demand in the window and the blocks kept
        free for it now (by a request of any other tenant)."""
        now = self._clock()
        active = self._active(now)
        weights = sum(self._tenants[name].weight for name in active)
        reserving = budget if self._enabled and len(active) >= 2 else None

        def row(name: str, t: _Tenant) -> TenantHeadroom:
            kept = self._room(t, reserving, weights, now) if reserving is not None and name in active else 0
            return {"active": name in active, "held_blocks": t.held, "demand_blocks": self._demand(t, now),
                    "headroom_blocks": kept}

        return {name: row(name, t) for name, t in sorted(self._tenants.items())}

    def publish(self, budget: int | None) -> None:
        """Set each tenant's headroom gauge as of now."""
        if self._record is None:
            return
        for name, row in self.status(budget).items():
            self._record(name, row["headroom_blocks"])

    # -- internals ---------------------------------------------------------------------------------
    def _tenant(self, name: str) -> _Tenant:
        t = self._tenants.get(name)
        if t is None:
            t = self._tenants[name] = _Tenant()
        return t

    def _move(self, t: _Tenant, *, held: int = 0, waiting: int = 0) -> None:
        before = t.level
        t.held += held
        t.waiting += waiting
        if t.level < before:
            # The level ``before`` ends now: it stays the tenant's peak for a window, unless a larger one ends later.
            while t.peaks and t.peaks[-1][1] <= before:
                t.peaks.pop()
            t.peaks.append((self._clock(), before))

    def _demand(self, t: _Tenant, now: float) -> int:
        """The most blocks ``t`` held and asked for at once within the window, now included."""
        while t.peaks and t.peaks[0][0] < now - self._window:
            t.peaks.popleft()
        return max(t.level, t.peaks[0][1] if t.peaks else 0)

    def _room(self, t: _Tenant, budget: int, weights: float, now: float) -> int:
        """The blocks kept free for ``t``: its demand, at most its fair share, beyond what it holds."""
        share = math.floor(budget * t.weight / weights + 1e-9)
        return max(0, min(self._demand(t, now), share) - t.held)

    def _active(self, now: float) -> list[str]:
        since = now - self._window
        return [name for name, t in self._tenants.items() if t.waiting > 0 or t.last_arrival >= since]


_IDLE: TenantHeadroom = {"active": False, "held_blocks": 0, "demand_blocks": 0, "headroom_blocks": 0}
