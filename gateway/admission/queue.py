"""The waiting line for KV capacity: a bounded queue with deadlines, priorities, fair shares between tenants and a
starvation bound.

Bounded by ``--max-queue`` (0: no queue, shed at once with 429); each request waits at most ``--queue-timeout``
(then 503). Requests wait in lanes. With fair queueing (``--fair-queueing on``) each tenant has its own lane, and
the next request comes from the waiting tenant with the smallest virtual token counter (see ``fairness``): a
tenant alone may use the whole engine, tenants that compete share it by weight. Off, one lane holds everyone.
Within a lane: higher priority first, then by arrival, each request's arrival pushed back by the ``shift`` the
controller gives it (``order``: the more work it brings, the later it counts as arriving, up to a bound, so that
short requests go first without any waiting much past its time); FIFO with no shift. When the next request
cannot be admitted, a smaller request behind it that fits (of the first ``PASSERS_TRIED`` smaller ones) may pass
it, at most ``--starvation-bound`` times; then it is served first.
``Retry-After`` is the queue position divided by the releases per second seen over the last minute, bounded to
1..60 s; with several tenants waiting, the position counts the other tenants' turns taken meanwhile.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Generic, Protocol, TypedDict, TypeVar

from gateway.admission.fairness import FairShare

DRAIN_WINDOW_SECONDS = 60.0
RETRY_AFTER_MIN, RETRY_AFTER_MAX = 1.0, 60.0
RETRY_AFTER_UNKNOWN = 5.0  # no release seen yet: nothing to estimate from
SHARED_LANE = ""  # the one lane without fair queueing
# The smaller requests behind a blocked head a pass tries, in queue order. Each try projects the request's usage
# (``policy``): trying all of a full queue on every release took a third of the gateway's loop at twice capacity
# (48 chat streams/s, 256 queued, py-spy), and its relays fell behind.
PASSERS_TRIED = 16


class Waiting(Protocol):
    """What the queue reads of a waiting request."""

    @property
    def priority(self) -> int: ...
    @property
    def blocks(self) -> int: ...
    @property
    def tenant(self) -> str: ...
    @property
    def weight(self) -> float: ...


W = TypeVar("W", bound=Waiting)
K = TypeVar("K")


class TenantStatus(TypedDict):
    """One tenant as ``/guard/status`` shows it."""

    weight: float
    counter: float
    queued: int


# Plain classes, not dataclasses: a dataclass generic in its item does not import compiled (``gateway/native.py``).
class _Lane(Generic[W]):
    __slots__ = ("entries", "keys", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.entries: list[_Entry[W]] = []  # sorted by key
        self.keys: list[tuple[int, float, int]] = []  # the entries' keys, for bisect


class _Entry(Generic[W]):
    __slots__ = ("deadline", "enqueued_at", "item", "key", "lane", "passed")

    def __init__(
        self, item: W, key: tuple[int, float, int], enqueued_at: float, deadline: float, lane: _Lane[W]
    ) -> None:
        self.item = item
        self.key = key  # (-priority, arrival + shift, arrival number): the order within a lane
        self.enqueued_at = enqueued_at
        self.deadline = deadline
        self.lane = lane
        self.passed = 0  # times a smaller request was admitted ahead of this one while it was next


class WaitQueue(Generic[W]):
    """Requests waiting for capacity, in admission order. Items are compared by identity.

    The counters advance in both modes (``served``), so that ``/guard/status`` shows the shares either way;
    only with ``fair`` do they choose the next request."""

    def __init__(self, starvation_bound: int, *, fair: bool = False) -> None:
        self._starvation_bound = starvation_bound
        self._fair = fair
        self.shares = FairShare()
        self._lanes: dict[str, _Lane[W]] = {}
        self._by_item: dict[W, _Entry[W]] = {}
        self._depth: dict[int, int] = {}
        self._tenant_depth: dict[str, int] = {}
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._by_item)

    def __iter__(self) -> Iterator[W]:
        return iter([e.item for lane in self._order() for e in lane.entries])

    def __contains__(self, item: object) -> bool:
        return item in self._by_item

    @property
    def fair(self) -> bool:
        return self._fair

    @property
    def depth(self) -> Mapping[int, int]:
        """Waiting requests by priority (priorities with none left out)."""
        return self._depth

    @property
    def depth_by_tenant(self) -> Mapping[str, int]:
        """Waiting requests by tenant (tenants with none left out)."""
        return self._tenant_depth

    def push(self, item: W, now: float, deadline: float, shift: float = 0.0) -> None:
        """Queue ``item``; ``shift``: seconds its place counts as later than its arrival (0: FIFO)."""
        tenant = item.tenant
        if tenant not in self._tenant_depth:
            self.shares.wake(tenant, item.weight, self._tenant_depth)
        name = tenant if self._fair else SHARED_LANE
        lane = self._lanes.get(name)
        if lane is None:
            lane = self._lanes[name] = _Lane(name)
        entry = _Entry(item, (-item.priority, now + shift, next(self._arrivals)), now, deadline, lane)
        at = bisect.bisect(lane.keys, entry.key)
        lane.keys.insert(at, entry.key)
        lane.entries.insert(at, entry)
        self._by_item[item] = entry
        self._depth[item.priority] = self._depth.get(item.priority, 0) + 1
        self._tenant_depth[tenant] = self._tenant_depth.get(tenant, 0) + 1

    def reshift(self, item: W, shift: float) -> None:
        """Give a waiting ``item`` its place at ``shift`` seconds after its arrival (it was queued with none)."""
        entry = self._by_item.get(item)
        if entry is None:
            return
        lane = entry.lane
        at = bisect.bisect_left(lane.keys, entry.key)
        del lane.entries[at], lane.keys[at]
        entry.key = (entry.key[0], entry.enqueued_at + shift, entry.key[2])
        at = bisect.bisect(lane.keys, entry.key)
        lane.keys.insert(at, entry.key)
        lane.entries.insert(at, entry)

    def remove(self, item: W) -> bool:
        """Take ``item`` out; False when it was not waiting."""
        entry = self._by_item.pop(item, None)
        if entry is None:
            return False
        lane = entry.lane
        at = bisect.bisect_left(lane.keys, entry.key)
        del lane.entries[at]
        del lane.keys[at]
        if not lane.entries:
            del self._lanes[lane.name]
        _decrement(self._depth, item.priority)
        if not _decrement(self._tenant_depth, item.tenant):
            self.shares.rest(item.tenant)
        return True

    def served(self, item: W, *, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        """Charge ``item``'s tenant for the tokens the engine served it: its prompt when it is admitted, its
        output when it ends."""
        self.shares.charge(item.tenant, item.weight, prompt_tokens=prompt_tokens, output_tokens=output_tokens)

    def head(self) -> W | None:
        """The request that goes next once it fits."""
        lane = self._next_lane()
        return lane.entries[0].item if lane is not None else None

    def position(self, item: W) -> int:
        """How many may be admitted ahead of ``item``: those ahead in its lane, and, with other tenants waiting,
        the turns they take meanwhile by their weights."""
        entry = self._by_item[item]
        ahead = bisect.bisect_left(entry.lane.keys, entry.key)
        if len(self._lanes) == 1:
            return ahead
        own = self.shares.weight(entry.lane.name)
        total = sum(self.shares.weight(name) for name in self._lanes)
        return math.ceil((ahead + 1) * total / own) - 1

    def backlog(self) -> Iterator[tuple[str, float, W, float]]:
        """Every waiting request as ``(lane, share, request, deadline)``, each lane in its order; ``share`` is the
        fraction of admissions the lane gets while the lanes now waiting compete, by weight (1 with one lane),
        as ``position`` counts the other tenants' turns."""
        total = sum(self.shares.weight(name) for name in self._lanes) if len(self._lanes) > 1 else 0.0
        for lane in self._order():
            share = self.shares.weight(lane.name) / total if total else 1.0
            for e in lane.entries:
                yield lane.name, share, e.item, e.deadline

    def enqueued_at(self, item: W) -> float:
        return self._by_item[item].enqueued_at

    def oldest_wait(self, now: float) -> float:
        """How long the request queued first of those still waiting has waited (0 with none)."""
        first = next(iter(self._by_item.values()), None)  # insertion order: the first queued first
        return 0.0 if first is None else now - first.enqueued_at

    def expired(self, now: float) -> list[W]:
        """The requests whose deadline has passed, in queue order."""
        return [e.item for lane in self._order() for e in lane.entries if e.deadline <= now]

    def nearest_deadline(self) -> float | None:
        return min((e.deadline for e in self._by_item.values()), default=None)

    def pick(self, fits: Callable[[W], bool]) -> W | None:
        """The next request to admit: the head if it fits, else one of the first ``PASSERS_TRIED`` smaller ones
        behind it that fits while the head has been passed fewer than the starvation bound times; None when
        nothing may go now."""
        order = self._order()
        if not order:
            return None
        first = order[0].entries[0]
        if fits(first.item):
            return first.item
        if first.passed >= self._starvation_bound:
            return None
        smaller = (
            e.item for lane in order for e in lane.entries if e is not first and e.item.blocks < first.item.blocks
        )
        passer = next((item for item in itertools.islice(smaller, PASSERS_TRIED) if fits(item)), None)
        if passer is not None:
            first.passed += 1
        return passer

    def tenants(self) -> dict[str, TenantStatus]:
        """Every tenant seen: its weight, its counter and how many of its requests wait."""
        return {
            name: {"weight": share["weight"], "counter": share["counter"], "queued": self._tenant_depth.get(name, 0)}
            for name, share in self.shares.status().items()
        }

    def _lane_order(self, lane: _Lane[W]) -> tuple[float, int, int]:
        # Ties (a tenant back from idle is lifted to exactly the smallest counter) go to the lane with fewer
        # waiting, so that a sparse tenant goes at the next release rather than after one more of a flood's
        # requests; then to the lane whose next request came first.
        return self.shares.counter(lane.name), len(lane.entries), lane.keys[0][2]

    def _next_lane(self) -> _Lane[W] | None:
        if len(self._lanes) <= 1:
            return next(iter(self._lanes.values()), None)
        return min(self._lanes.values(), key=self._lane_order)

    def _order(self) -> list[_Lane[W]]:
        """The lanes in the order they would be served if no counter moved."""
        if len(self._lanes) <= 1:
            return list(self._lanes.values())
        return sorted(self._lanes.values(), key=self._lane_order)


def _decrement(counts: dict[K, int], key: K) -> int:
    """Count one less under ``key``, dropping it at zero; returns what is left."""
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]
    return left


class Drain:
    """How fast requests leave: releases per second over the last minute, for ``Retry-After``."""

    def __init__(self, window: float = DRAIN_WINDOW_SECONDS) -> None:
        self._window = window
        self._releases: deque[float] = deque()

    def note(self, now: float) -> None:
        self._releases.append(now)
        while self._releases[0] < now - self._window:
            self._releases.popleft()

    def rate(self, now: float) -> float | None:
        """Releases per second within the window before ``now``; None when there were none."""
        first = bisect.bisect_left(self._releases, now - self._window)
        if first == len(self._releases):
            return None
        return (len(self._releases) - first) / max(1.0, now - self._releases[first])

    def retry_after(self, position: int, now: float) -> float:
        """Seconds until a request at ``position`` in the queue may expect its turn, bounded to 1..60."""
        rate = self.rate(now)
        estimate = RETRY_AFTER_UNKNOWN if rate is None else (position + 1) / rate
        return min(RETRY_AFTER_MAX, max(RETRY_AFTER_MIN, estimate))


class DeadlineTimer:
    """Runs ``on_due`` at the nearest deadline in the queue, for as long as anything waits."""

    def __init__(
        self, queue: WaitQueue[W], on_due: Callable[[], None], *,
        clock: Callable[[], float], sleep: Callable[[float], Awaitable[None]],
    ) -> None:
        self._queue = queue
        self._on_due = on_due
        self._clock = clock
        self._sleep = sleep
        self._task: asyncio.Task[None] | None = None

    def ensure(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="admission-deadlines")

    def stop_if_empty(self) -> None:
        # The timer's own pass empties the queue too; it then ends by itself.
        if not self._queue and self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
            self._task = None

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        while (nearest := self._queue.nearest_deadline()) is not None:
            await self._sleep(max(0.0, nearest - self._clock()))
            self._on_due()
