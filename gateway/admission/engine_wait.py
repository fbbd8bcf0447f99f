"""How long requests wait in the engine's own queue, from what the gateway sees: Little's law over a window.

vLLM queues a request it has no room to start (``vllm:num_requests_waiting``); the gateway bounds only the wait in
its own queue. With a cache large enough that the engine's prefill binds before its blocks do (1,024 blocks at
twice capacity, docs/realistic.md), the gateway admits on KV room into vLLM's growing queue, where no wait is
bounded: the admitted waited 2.1-2.7 s there on average, and first tokens came past the bound in the runs where the
engine ran slower. With 256 or 512 blocks the cache binds first and vLLM's queue held a request 0.01-0.03 s.

The mean wait there is the mean number waiting over the mean rate at which requests leave the queue (Little's law),
and both are at hand without a new metric: the number waiting is every engine snapshot's, and each request leaves
vLLM's queue once and then streams its first token (a whole answer, which tells no first token, counts as it ends:
late, but the rate over the window holds in a steady overload). A count held between snapshots stands for their
interval. The count is the gateway's own (``Deadlines.steer`` gives at most its requests in flight without a first
token): a queue of requests that reached the engine around the gateway is not its requests' wait.
"""

from __future__ import annotations

from collections import deque

WINDOW_SECONDS = 5.0  # the trailing time the mean is taken over: 20 snapshots at the default scrape interval
MIN_DEPARTURES = 8  # departures in the window below which the rate is too coarse to say anything


class EngineQueueWait:
    """The mean seconds a request waited in the engines' own queues over the last ``WINDOW_SECONDS``."""

    def __init__(self, window: float = WINDOW_SECONDS) -> None:
        self._window = window
        self._waiting: dict[int, int] = {}  # each engine's count at its last snapshot
        self._counts: deque[tuple[float, int]] = deque()  # (when, the engines' waiting summed then)
        self._departures: deque[float] = deque()  # when each request left the queue (``departed``)

    def snapshot(self, now: float, engine: int, waiting: int) -> None:
        """An engine's snapshot at ``now`` showed ``waiting`` requests in its own queue."""
        self._waiting[engine] = waiting
        self._counts.append((now, sum(self._waiting.values())))
        self._prune(now)

    def departed(self, now: float) -> None:
        """A request left the engine's queue by ``now``: its first token came, or it ended without one timed."""
        self._departures.append(now)
        self._prune(now)

    def seconds(self, now: float) -> float | None:
        """The mean wait in the engines' queues over the window; None while too few requests left them to say."""
        self._prune(now)
        if len(self._departures) < MIN_DEPARTURES or not self._counts:
            return None
        start = max(self._counts[0][0], now - self._window)  # the first kept count holds from before the window
        span = now - start
        if span <= 0:
            return None
        # The time-weighted mean count: each snapshot's count holds until the next one (the last until now).
        edges = [start] + [t for t, _ in list(self._counts)[1:]] + [now]
        held = sum(count * (edges[i + 1] - edges[i]) for i, (_, count) in enumerate(self._counts))
        departures = sum(1 for t in self._departures if t >= start)
        # Little's law: (held / span) waiting on average, leaving at (departures / span) a second.
        return held / departures if departures >= MIN_DEPARTURES else None

    def ahead(self, now: float) -> float:
        """The wait a request admitted now has ahead of it in the engines' queues: those waiting at the last
        snapshots over the rate requests left them lately (0 while too few left to say)."""
        self._prune(now)
        waiting = self._counts[-1][1] if self._counts else 0
        if not waiting or len(self._departures) < MIN_DEPARTURES:
            return 0.0
        span = min(self._window, now - min(self._departures[0], self._counts[0][0]))
        return waiting * span / len(self._departures) if span > 0 else 0.0

    def _prune(self, now: float) -> None:
        edge = now - self._window
        while len(self._counts) > 1 and self._counts[1][0] <= edge:
            self._counts.popleft()  # the first kept count holds from before the edge
        while self._departures and self._departures[0] < edge:
            self._departures.popleft()
