"""The waiting line for KV capacity: a bounded priority queue with deadlines and a starvation bound.

Bounded by ``--max-queue`` (0: no queue, shed at once with 429); each request waits at most ``--queue-timeout``
(then 503). Higher priority first, FIFO within a priority. When the head cannot be admitted, a smaller request
behind it that fits may pass it, at most ``--starvation-bound`` times; then the head is served first.
``Retry-After`` is the queue position divided by the releases per second seen over the last minute, bounded
to 1..60 s.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

DRAIN_WINDOW_SECONDS = 60.0
RETRY_AFTER_MIN, RETRY_AFTER_MAX = 1.0, 60.0
RETRY_AFTER_UNKNOWN = 5.0  # no release seen yet: nothing to estimate from


class Waiting(Protocol):
    """What the queue reads of a waiting request."""

    @property
    def priority(self) -> int: ...
    @property
    def blocks(self) -> int: ...


W = TypeVar("W", bound=Waiting)


@dataclass
class _Entry(Generic[W]):
    item: W
    key: tuple[int, int]  # (-priority, arrival): the queue's order
    enqueued_at: float
    deadline: float
    passed: int = 0  # times a smaller request was admitted ahead of this one while it was the head


class WaitQueue(Generic[W]):
    """Requests waiting for capacity, in admission order. Items are compared by identity."""

    def __init__(self, starvation_bound: int) -> None:
        self._starvation_bound = starvation_bound
        self._entries: list[_Entry[W]] = []  # sorted by key
        self._keys: list[tuple[int, int]] = []  # the entries' keys, for bisect
        self._by_item: dict[W, _Entry[W]] = {}
        self._depth: dict[int, int] = {}
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[W]:
        return iter([e.item for e in self._entries])

    def __contains__(self, item: object) -> bool:
        return item in self._by_item

    @property
    def depth(self) -> Mapping[int, int]:
        """Waiting requests by priority (priorities with none left out)."""
        return self._depth

    def push(self, item: W, now: float, deadline: float) -> None:
        entry = _Entry(item, (-item.priority, next(self._arrivals)), now, deadline)
        at = bisect.bisect(self._keys, entry.key)
        self._keys.insert(at, entry.key)
        self._entries.insert(at, entry)
        self._by_item[item] = entry
        self._depth[item.priority] = self._depth.get(item.priority, 0) + 1

    def remove(self, item: W) -> bool:
        """Take ``item`` out; False when it was not waiting."""
        entry = self._by_item.pop(item, None)
        if entry is None:
            return False
        at = bisect.bisect_left(self._keys, entry.key)
        del self._entries[at]
        del self._keys[at]
        left = self._depth[item.priority] - 1
        if left:
            self._depth[item.priority] = left
        else:
            del self._depth[item.priority]
        return True

    def head(self) -> W | None:
        return self._entries[0].item if self._entries else None

    def position(self, item: W) -> int:
        """How many wait ahead of ``item``."""
        return bisect.bisect_left(self._keys, self._by_item[item].key)

    def enqueued_at(self, item: W) -> float:
        return self._by_item[item].enqueued_at

    def expired(self, now: float) -> list[W]:
        """The requests whose deadline has passed, in queue order."""
        return [e.item for e in self._entries if e.deadline <= now]

    def nearest_deadline(self) -> float | None:
        return min((e.deadline for e in self._entries), default=None)

    def pick(self, fits: Callable[[W], bool]) -> W | None:
        """The next request to admit: the head if it fits, else a smaller one behind it that fits while the
        head has been passed fewer than the starvation bound times; None when nothing may go now."""
        if not self._entries:
            return None
        first = self._entries[0]
        if fits(first.item):
            return first.item
        if first.passed >= self._starvation_bound:
            return None
        passer = next(
            (e.item for e in self._entries[1:] if e.item.blocks < first.item.blocks and fits(e.item)), None
        )
        if passer is not None:
            first.passed += 1
        return passer


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
