"""The headroom for active tenants: the room a request leaves for the other tenants sending now, on a fake clock."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from gateway.admission.headroom import ACTIVE_WINDOW_S, Headroom
from tests.support.clock import FakeClock

BUDGET = 32
T0 = 1000.0


@dataclass(eq=False)  # the headroom keys requests by identity
class Req:
    tenant: str
    blocks: int
    weight: float = 1.0


@dataclass
class Tenants:
    """A headroom on a fake clock, and the requests each tenant holds."""

    enabled: bool = True
    clock: FakeClock = field(default_factory=lambda: FakeClock(T0))
    held: dict[str, list[Req]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.headroom = Headroom(enabled=self.enabled, clock=self.clock)

    def hold(self, tenant: str, *sizes: int, weight: float = 1.0) -> Tenants:
        """Requests of ``tenant`` arrive and are admitted at once."""
        for blocks in sizes:
            r = Req(tenant, blocks, weight)
            self.headroom.arrive(r)
            self.headroom.dequeued(r)
            self.headroom.commit(r)
            self.held.setdefault(tenant, []).append(r)
        return self

    def wait(self, tenant: str, *sizes: int, weight: float = 1.0) -> Tenants:
        """Requests of ``tenant`` arrive and stay in the queue."""
        for blocks in sizes:
            self.headroom.arrive(Req(tenant, blocks, weight))
        return self

    def end(self, tenant: str, count: int = 1) -> Tenants:
        """``count`` of ``tenant``'s admitted requests end."""
        for _ in range(count):
            self.headroom.release(self.held[tenant].pop(0))
        return self

    def later(self, seconds: float) -> Tenants:
        self.clock.now += seconds
        return self

    def reserved(self, tenant: str, blocks: int, weight: float = 1.0) -> int:
        return self.headroom.reserved(Req(tenant, blocks, weight), BUDGET)


Case = Callable[[Tenants], Tenants]
W = ACTIVE_WINDOW_S


@pytest.mark.parametrize(
    ("story", "asking", "expected"),
    [
        # A tenant alone may use the whole budget.
        (lambda t: t.hold("flood", 8, 8, 8), ("flood", 8), 0),
        # A quiet tenant that sent one request keeps room for one like it, while the flood holds the rest.
        (lambda t: t.hold("quiet", 1).end("quiet").hold("flood", 8, 8, 8).later(1), ("flood", 8), 1),
        # Its demand is the most it held at once in the window; what it holds now is counted off.
        (lambda t: t.hold("quiet", 1, 2).end("quiet").hold("flood", 8, 8), ("flood", 8), 1),
        # Requests still waiting count in the demand, up to the tenant's fair share: half the budget here.
        (lambda t: t.wait("quiet", 10, 10, 10), ("flood", 8), 16),
        (lambda t: t.wait("quiet", 10, 10, 10, weight=3.0), ("flood", 8), 24),  # 3/4 of the budget
        (lambda t: t.wait("quiet", 10, 10, weight=3.0), ("flood", 8), 20),  # its demand, under its share
        # A tenant that holds its fair share already is kept nothing more.
        (lambda t: t.hold("quiet", 8, 8).wait("quiet", 8), ("flood", 8), 0),
        # The room is kept for a window after the tenant's last request, then given back.
        (lambda t: t.hold("quiet", 1).end("quiet").later(W - 1), ("flood", 8), 1),
        (lambda t: t.hold("quiet", 1).end("quiet").later(W + 1), ("flood", 8), 0),
        # A tenant still waiting is active however long ago it sent.
        (lambda t: t.wait("quiet", 1).later(W + 10), ("flood", 8), 1),
        # A peak counts for a window after it ended, then the demand falls back to what the tenant asks now.
        (lambda t: t.hold("quiet", 1, 1, 1).end("quiet", 2).later(10).wait("quiet", 1), ("flood", 8), 2),
        (lambda t: t.hold("quiet", 1, 1, 1).end("quiet", 2).later(W + 1).wait("quiet", 1), ("flood", 8), 1),
        # Each other active tenant keeps its own room.
        (lambda t: t.hold("a", 2).end("a").hold("b", 3).end("b"), ("c", 8), 5),
        # Never more than the budget has beyond the request and what the others hold: a request larger than its
        # fair share cannot be held back for as long as the others send.
        (lambda t: t.wait("quiet", 8, 8), ("flood", 24), 8),
        (lambda t: t.hold("quiet", 4).wait("quiet", 8, 8), ("flood", 24), 4),
        (lambda t: t.hold("quiet", 8).wait("quiet", 8), ("flood", 30), 0),
    ],
)
def test_the_room_a_request_leaves_for_the_other_active_tenants(
    story: Case, asking: tuple[str, int], expected: int
) -> None:
    tenants = story(Tenants())
    assert tenants.reserved(*asking) == expected


def test_switched_off_it_keeps_count_but_reserves_nothing() -> None:
    tenants = Tenants(enabled=False).hold("quiet", 1).end("quiet").hold("flood", 8, 8, 8)
    assert tenants.reserved("flood", 8) == 0
    assert tenants.headroom.status(BUDGET)["quiet"] == {
        "active": True, "held_blocks": 0, "demand_blocks": 1, "headroom_blocks": 0,
    }


def test_status_shows_who_is_active_what_each_holds_and_the_room_kept_for_it() -> None:
    tenants = Tenants().hold("quiet", 1).end("quiet").hold("flood", 8, 8, 8).wait("flood", 8)
    assert tenants.headroom.status(BUDGET) == {
        "flood": {"active": True, "held_blocks": 24, "demand_blocks": 32, "headroom_blocks": 0},
        "quiet": {"active": True, "held_blocks": 0, "demand_blocks": 1, "headroom_blocks": 1},
    }
    tenants.later(W + 1)
    assert tenants.headroom.status(BUDGET)["quiet"] == {
        "active": False, "held_blocks": 0, "demand_blocks": 0, "headroom_blocks": 0,
    }
    # The flood still waits: active, and alone it is kept nothing.
    assert tenants.headroom.status(BUDGET)["flood"]["headroom_blocks"] == 0
    assert tenants.headroom.status(None)["flood"]["active"] is True  # capacity unknown: nothing is kept


def test_annotate_adds_the_headroom_to_each_tenants_row() -> None:
    tenants = Tenants().hold("quiet", 1).end("quiet").hold("flood", 8)
    rows = {"flood": {"queued": 0}, "default": {"queued": 0}}
    assert tenants.headroom.annotate(rows, BUDGET) == {
        "default": {"queued": 0, "active": False, "held_blocks": 0, "demand_blocks": 0, "headroom_blocks": 0},
        "flood": {"queued": 0, "active": True, "held_blocks": 8, "demand_blocks": 8, "headroom_blocks": 0},
        "quiet": {"active": True, "held_blocks": 0, "demand_blocks": 1, "headroom_blocks": 1},
    }


def test_publish_sets_each_tenants_gauge() -> None:
    seen: dict[str, int] = {}
    headroom = Headroom(enabled=True, clock=FakeClock(T0), record=seen.__setitem__)
    for r in (Req("quiet", 2), Req("flood", 8)):
        headroom.arrive(r)
    headroom.publish(BUDGET)
    assert seen == {"quiet": 2, "flood": 8}


def test_leaving_the_queue_or_ending_twice_counts_once() -> None:
    tenants = Tenants()
    r = Req("quiet", 3)
    tenants.headroom.arrive(r)
    tenants.headroom.dequeued(r)
    tenants.headroom.dequeued(r)  # refused after it left: nothing more to take back
    tenants.headroom.release(r)  # never admitted: held nothing
    assert tenants.headroom.status(BUDGET)["quiet"]["held_blocks"] == 0
    assert tenants.headroom.status(BUDGET)["quiet"]["demand_blocks"] == 3


def test_the_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="above 0 seconds; got 0"):
        Headroom(enabled=True, window=0)
