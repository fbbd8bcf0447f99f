"""How long a queued request can expect to wait for KV capacity, and which ones will not be admitted in time.

Capacity comes back as admitted requests end. The forecast counts the blocks the books free per second of
*backlog*, time during which requests waited while others ran (time without a queue is left out: the engine was
not the limit then, and counting it would make capacity look scarcer than it is), over the releases of the last
minute of backlog (an idle spell between two bursts keeps the rate seen before it). A queued request goes once
the blocks freed cover what waits ahead of it and its own need, less the blocks free now:

    expected wait = max(0, blocks ahead + own blocks - free blocks) / blocks freed per second

Blocks, not requests: sizes vary by an order of magnitude (70 prompt and 50 output tokens, or 1,330 and 950,
in the same flood), and a queue of large requests drains slower than its length says. The rate is measured
from the first release in the window to the last, so it does not sag between two releases (a sag that, checked
on every pass, would shed on noise); a stall does not raise the estimate either: requests then wait out their
timeout as before.

A request is judged as it arrives, at the rate seen, and queued only when that rate admits it within
``ARRIVAL_SHARE`` of the time it may wait: the rest is slack for a rate that moves while it waits. One forecast to
miss that is refused then, within moments of its arrival, rather than after waiting most of its deadline out for
a refusal all the same (under a sustained overload with a 5-s objective, judged with the margin below from the
start, refusals came a p99 of 7.2 s after arrival; judged at the rate seen with no slack, the queue settled where
every newcomer was forecast just within its deadline, and 29% of the refusals came 1-5 s after arrival, as the
rate dipped under the forecast of requests already queued). Once queued, shedding is conservative. A queued
request is refused only when it would still miss its deadline if capacity came back ``SPEEDUP_MARGIN +
SPEEDUP_PER_ROOT / sqrt(releases)`` times faster than seen (1.71x after 6 releases, 1.29x after 64: a count of
releases is uncertain by about its square root), as when the engine slowed down or requests were placed ahead of
it; never before ``MIN_RELEASES`` releases were seen while requests waited, never while nothing is in flight or
admission is paused, never when nothing need be freed for it, and never in the last ``LAST_SHARE`` of its
timeout: a refusal then would save no wait, and turn a request that might still go at the next release (the
head's turn comes with one release, not at an average rate) into a refusal; it waits on, and is admitted or times
out as before. Each pass over the queue checks every waiting request in order: one whose wait grew past its
deadline learns it then, and a request refused frees its place for those behind it in the same pass.

Why these figures: on a model of the benchmark's overload (64 requests at 6/s, 700 +- 90% prompt and 500 +- 90%
output tokens, a 31-block budget), the actual wait over the estimate ranged (5th to 95th percentile) 0.74-1.67
for blocks and 0.67-1.85 for a count of requests after 4 releases, 0.81-1.43 and 0.81-1.56 after 8. With this
margin and at least 6 releases, none of 1,582 estimates was too high by more than the margin (1% after 4).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from typing import Final, Generic, TypeVar

from gateway.admission.queue import Waiting

WINDOW_SECONDS = 60.0
MIN_RELEASES = 6
SPEEDUP_MARGIN, SPEEDUP_PER_ROOT = 1.1, 1.5
LAST_SHARE = 0.1  # of the queue timeout, in which nobody is refused by the forecast
ARRIVAL_SHARE = 0.8  # of its time to wait, within which an arriving request must be forecast to go

W = TypeVar("W", bound=Waiting)


class Late(Generic[W]):
    """A queued request that will not be admitted before its deadline, as forecast. (A plain class: a dataclass
    generic in its item does not import compiled, ``gateway/native.py``.)"""

    __slots__ = ("arriving", "behind", "blocks_ahead", "blocks_per_second", "expected_wait", "in_flight", "item",
                 "position", "time_left")

    def __init__(
        self, item: W, expected_wait: float, time_left: float, position: int, blocks_ahead: int,
        blocks_per_second: float, in_flight: int, arriving: bool = False, behind: bool = False,
    ) -> None:
        self.item = item
        self.expected_wait = expected_wait  # seconds, at the rate seen
        self.time_left = time_left  # seconds to its deadline
        self.position = position  # requests to be admitted ahead of it
        self.blocks_ahead = blocks_ahead  # blocks they need, its own excluded
        self.blocks_per_second = blocks_per_second
        self.in_flight = in_flight  # requests whose release it waits for
        self.arriving = arriving  # judged as it arrived: within ``ARRIVAL_SHARE`` of its time
        self.behind = behind  # arriving behind a request already past the time its objective gave it


class _Release:
    """One release during a backlog: a plain class (compiled), not a frozen dataclass (``pace._Sample``'s note)."""

    def __init__(self, at: float, backlog: float, blocks: int) -> None:
        self.at: Final = at
        self.backlog: Final = backlog  # the backlog clock at the release
        self.blocks: Final = blocks


class ReleaseRate:
    """Blocks freed per second of backlog, over a window of releases."""

    def __init__(self, window: float = WINDOW_SECONDS) -> None:
        self._window = window
        self._releases: deque[_Release] = deque()
        self._blocks = 0  # the blocks of ``_releases``: kept as they come and go, since every pass reads the rate
        self._backlog_total = 0.0  # seconds of backlog before ``_since``
        self._since: float | None = None  # start of the backlog under way; None: none under way

    def backlog(self, now: float, on: bool) -> None:
        """Whether requests wait while others run, from ``now`` on."""
        if on and self._since is None:
            self._since = now
        elif not on and self._since is not None:
            self._backlog_total += now - self._since
            self._since = None

    def released(self, now: float, blocks: int) -> None:
        """``blocks`` freed at ``now``; counted only during a backlog."""
        if self._since is None or blocks <= 0:
            return
        self._releases.append(_Release(now, self._clock(now), blocks))
        self._blocks += blocks
        self._prune(now)

    def rate(self, now: float) -> tuple[float, int] | None:
        """Blocks per second of backlog and the releases it rests on; None before two releases a moment apart."""
        self._prune(now)
        releases = self._releases
        if len(releases) < 2:
            return None
        span = releases[-1].backlog - releases[0].backlog
        if span <= 0:
            return None
        # The first release opens the span, so its blocks were freed before it: counted out.
        return (self._blocks - releases[0].blocks) / span, len(releases)

    def _clock(self, now: float) -> float:
        return self._backlog_total + (now - self._since if self._since is not None else 0.0)

    def _prune(self, now: float) -> None:
        # The window is one of backlog time, as the rate is: an idle spell keeps the rate seen before it, so that
        # the first requests of the next burst are judged by it rather than all queued while nothing is known
        # (in one three-run sustained overload, two runs began with 111 and 220 refusals 1-5 s late).
        since = self._clock(now) - self._window
        while self._releases and self._releases[0].backlog < since:
            self._blocks -= self._releases.popleft().blocks


def speedup_margin(releases: int) -> float:
    """How much faster than seen capacity must be assumed to come back before a request is shed."""
    return SPEEDUP_MARGIN + SPEEDUP_PER_ROOT / math.sqrt(releases)


class Forecast:
    """The expected wait of queued requests, and which of them will miss their deadline."""

    def __init__(
        self, *, enabled: bool, timeout: float, clock: Callable[[], float], window: float = WINDOW_SECONDS
    ) -> None:
        self.enabled = enabled
        self._last_moments = LAST_SHARE * timeout
        self._clock = clock
        self._rate = ReleaseRate(window)

    def observe(self, *, backlogged: bool) -> None:
        """Requests wait while others run (or not), from now on."""
        self._rate.backlog(self._clock(), backlogged)

    def released(self, blocks: int) -> None:
        """The books freed ``blocks`` now."""
        self._rate.released(self._clock(), blocks)

    def rate(self) -> tuple[float, int] | None:
        """Blocks freed per second of backlog and the releases it rests on; None while fewer than
        ``MIN_RELEASES`` were seen."""
        seen = self._rate.rate(self._clock())
        return seen if seen is not None and seen[1] >= MIN_RELEASES else None

    def expected_wait(self, blocks: int, free: int) -> float | None:
        """Seconds until ``blocks`` (what waits ahead and the request's own need) fit where ``free`` blocks are
        free now; None while the rate is unknown."""
        seen = self.rate()
        if seen is None:
            return None
        return max(0, blocks - free) / seen[0]

    def late(
        self, backlog: Iterable[tuple[str, float, W, float]], free: int, in_flight: int,
        span: Callable[[W], float] | None = None, arriving: W | None = None, due: float | None = None,
        overdue: Callable[[W], bool] | None = None,
    ) -> list[Late[W]]:
        """The requests of ``backlog`` (``(lane, share, request, deadline)`` in each lane's order, as
        ``WaitQueue.backlog`` gives them) that would miss their deadline: ``arriving``, the request just queued,
        when the rate seen would not admit it within ``ARRIVAL_SHARE`` of its time; the others even at the
        margin's faster rate; ``due``: when ``arriving`` must be admitted by, where that is sooner than the deadline
        it is queued with (an objective judges it as it arrives only); ``overdue``: whether a queued request is past
        the time its objective gave it, which makes ``arriving``, behind it, late too (the rate has fallen under
        what was forecast: a queue behind its objectives is not joined, whatever the rate says). ``span``: how long
        a request may wait in all (its own deadline may be shorter than the queue timeout); none is refused in the
        last ``LAST_SHARE`` of it."""
        seen = self.rate()
        if not self.enabled or seen is None or in_flight == 0:
            return []
        rate, releases = seen
        fast = rate * speedup_margin(releases)
        free = max(0, free)  # adaptive may hold more than the budget: nothing is free then
        now = self._clock()
        ahead: dict[str, tuple[int, int]] = {}  # per lane: blocks and requests kept ahead so far
        found: list[Late[W]] = []
        behind: set[str] = set()  # lanes with a request ahead past the time its objective gave it
        for lane, share, item, deadline in backlog:
            blocks, count = ahead.get(lane, (0, 0))
            through = math.ceil((blocks + item.blocks) / share)  # with other lanes' turns taken meanwhile
            need = max(0, through - free)
            time_left = (due if item is arriving and due is not None else deadline) - now
            last_moments = self._last_moments if span is None else LAST_SHARE * span(item)
            overdue_ahead = False
            if item is arriving:
                overdue_ahead = need > 0 and due is not None and lane in behind
                late = overdue_ahead or (need > 0 and need / rate > ARRIVAL_SHARE * time_left)
            else:
                late = need > 0 and need / fast > time_left >= last_moments
            if late:
                position = math.ceil((count + 1) / share) - 1
                found.append(Late(
                    item, need / rate, time_left, position, through - item.blocks, rate, in_flight, item is arriving,
                    overdue_ahead,
                ))
                continue  # refused: it frees its place for those behind it
            if overdue is not None and overdue(item):
                behind.add(lane)
            ahead[lane] = (blocks + item.blocks, count + 1)
        return found

    def status(self) -> dict[str, float | int | bool | None]:
        """The forecast as ``/guard/status`` shows it."""
        seen = self._rate.rate(self._clock())
        return {
            "enabled": self.enabled,
            "blocks_freed_per_s": None if seen is None else round(seen[0], 3),
            "releases": 0 if seen is None else seen[1],
            "ready": seen is not None and seen[1] >= MIN_RELEASES,
        }
