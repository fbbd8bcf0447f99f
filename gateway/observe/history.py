"""The live page's memory: what the gateway looked like each second over the last ten minutes.

A ``Sampler``'s periodic loop, owned by the app's lifespan, reads once a second what already exists (the admission
status, the upstream's state, the Prometheus counters) into a ``History`` of fixed size. The request path pays
nothing for it beyond one bounded append per TTFT and per admission (``Metrics.recent_*``), from which the
sampler computes percentiles over a trailing window.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

from gateway.metrics import Metrics
from gateway.periodic import Periodic

log = logging.getLogger(__name__)

SAMPLES = 600  # ten minutes of one-second samples
EVENTS = 200  # upstream state changes and restarts remembered
PERCENTILE_WINDOW = 60  # samples (seconds) the TTFT and queue-wait percentiles look back over
VALUES_PER_SAMPLE = 32  # values kept per second for the percentiles: a 60 s window sorts at most 1,920
PERCENTILES = (50, 90, 99)

Sample = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Event:
    """The upstream changed state or restarted, seen at sample ``id``."""

    id: int
    t: float
    state: str
    restarts: int
    reason: str | None

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "t": self.t, "state": self.state, "restarts": self.restarts, "reason": self.reason}


class History:
    """The newest ``size`` samples and ``events`` events, each numbered from 1 in arrival order."""

    def __init__(self, size: int = SAMPLES, events: int = EVENTS) -> None:
        if size < 1 or events < 1:
            raise ValueError("a history holds at least one sample and one event")
        self._samples: deque[Sample] = deque(maxlen=size)
        self._events: deque[Event] = deque(maxlen=events)
        self._ids = itertools.count(1)
        self.size = size

    @property
    def last_id(self) -> int:
        return self._samples[-1]["id"] if self._samples else 0

    @property
    def latest(self) -> Sample | None:
        return self._samples[-1] if self._samples else None

    def add(self, sample: Sample) -> Sample:
        """Store ``sample`` under the next id (written into it) and return it."""
        sample["id"] = next(self._ids)
        self._samples.append(sample)
        return sample

    def add_event(self, event: Event) -> None:
        self._events.append(event)

    def since(self, after: int | None) -> list[Sample]:
        """Samples newer than id ``after``; all of them for None, and for an id this history never gave
        (a client that watched an earlier run of the gateway must not wait forever for ids to catch up)."""
        if after is None or after > self.last_id or not self._samples:
            return list(self._samples)
        first = self._samples[0]["id"]
        # Ids are consecutive: the newer samples are the deque's tail.
        return list(itertools.islice(self._samples, max(0, after - first + 1), None))

    def events_since(self, after: int | None) -> list[dict[str, Any]]:
        if after is None or after > self.last_id:
            return [e.as_dict() for e in self._events]
        return [e.as_dict() for e in self._events if e.id > after]


def percentiles(values: Iterable[float], ps: Iterable[int] = PERCENTILES) -> dict[str, float | None]:
    """Nearest-rank percentiles of ``values`` (each ``None`` when there are none), plus their count ``n``."""
    ordered = sorted(values)
    out: dict[str, float | None] = {f"p{p}": _rank(ordered, p) for p in ps}
    out["n"] = len(ordered)
    return out


def _rank(ordered: list[float], p: int) -> float | None:
    if not ordered:
        return None
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def thinned(values: list[float], most: int) -> list[float]:
    """At most ``most`` of ``values``, evenly spaced: a fair sample of a second's values for percentiles."""
    if len(values) <= most:
        return values
    step = len(values) / most
    return [values[int(i * step)] for i in range(most)]


def counter_totals(counter: Counter) -> dict[str, float]:
    """A counter's current totals by its label values joined with '/' ('' when it has no labels)."""
    totals: dict[str, float] = {}
    for family in counter.collect():
        for s in family.samples:
            if s.name.endswith("_total"):
                totals["/".join(s.labels.values())] = s.value
    return totals


class Sampler:
    """Samples the gateway into a ``History`` every ``interval`` seconds while started.

    ``admission_status`` and ``upstream_status`` are the dictionaries ``/guard/status`` is made of;
    ``clock`` times the rates, ``wall`` stamps the samples for display.
    """

    def __init__(
        self,
        history: History,
        metrics: Metrics,
        admission_status: Callable[[], dict[str, Any]],
        upstream_status: Callable[[], dict[str, Any]],
        *,
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.history = history
        self._metrics = metrics
        self._admission_status = admission_status
        self._upstream_status = upstream_status
        self.interval = interval
        self._clock = clock
        self._wall = wall
        # The first sample waits one interval: before the engine's first scrape its state is unknown, and a sample
        # at once would show it down. A bug in a sample must not end the history, nor reach the request path.
        self._timer = Periodic(
            lambda: self.sample(), lambda: self.interval, name="ui-history", immediately=False,
            failed="sampling the gateway for /guard/ui failed", logger=log, sleep=sleep,
        )
        self._previous: tuple[float, dict[str, dict[str, float]]] | None = None
        self._ttft: deque[list[float]] = deque(maxlen=PERCENTILE_WINDOW)
        self._queue_wait: deque[list[float]] = deque(maxlen=PERCENTILE_WINDOW)
        self._upstream: tuple[str, int] | None = None
        self.cost_s = 0.0  # what the last sample took, shown beside the data
        self.started: float | None = None  # when this history began: a page that saw another start over

    async def start(self) -> None:
        self.started = round(self._wall(), 3)
        self._timer.start()

    async def stop(self) -> None:
        await self._timer.stop()

    def sample(self) -> Sample:
        """Take one sample now, store it, and return it."""
        t0 = time.perf_counter()
        now = self._clock()
        status = self._admission_status()
        upstream = self._upstream_status()
        engine = status.get("engine") or {}
        sample: Sample = {
            "t": round(self._wall(), 3),
            "kv": {
                "capacity": status.get("capacity_blocks"),
                "budget": status.get("budget_blocks"),
                "committed": status.get("committed_blocks"),
                "live_used": status.get("live_used_blocks"),
                "admit_limit": status.get("admit_limit_blocks"),
                "block_size": status.get("block_size"),
            },
            "in_flight": status.get("in_flight"),
            "queued": status.get("queued"),
            "queued_by_priority": status.get("queued_by_priority") or {},
            "engine": {"running": engine.get("running"), "waiting": engine.get("waiting"),
                       "stale": engine.get("stale")},
            "rates": self._rates(now),
            "ttft_ms": self._window(self._ttft, self._metrics.recent_ttft),
            "queue_wait_ms": self._window(self._queue_wait, self._metrics.recent_queue_wait),
            "upstream": {"state": upstream.get("state"), "restarts": upstream.get("restarts") or 0,
                         "last_restart_reason": upstream.get("last_restart_reason")},
        }
        stored = self.history.add(sample)
        self._note_upstream(stored)
        self.cost_s = time.perf_counter() - t0
        return stored

    def _rates(self, now: float) -> dict[str, dict[str, float]]:
        """Per-second increases of the counters since the previous sample, by label."""
        m = self._metrics
        totals = {
            "admitted": counter_totals(m.admissions),
            "rejected": counter_totals(m.rejections),
            "clamped": _summed(counter_totals(m.clamps)),
            "truncated": _summed(counter_totals(m.truncations)),
            "completed": _summed({k: v for k, v in counter_totals(m.requests).items() if k.endswith("/ok")}),
            "preempted": counter_totals(m.engine_preemptions),
        }
        previous, self._previous = self._previous, (now, totals)
        if previous is None:
            return {name: {} for name in totals}
        then, before = previous
        elapsed = max(now - then, 1e-6)
        rates: dict[str, dict[str, float]] = {}
        for name, by_label in totals.items():
            old = before.get(name, {})
            rates[name] = {
                label: round(max(0.0, value - old.get(label, 0.0)) / elapsed, 3)
                for label, value in by_label.items()
                if value != old.get(label, 0.0)
            }
        return rates

    def _window(self, window: deque[list[float]], recent: deque[float]) -> dict[str, float | None]:
        """Percentiles in milliseconds over the trailing window, with this second's values taken in."""
        taken = list(recent)
        recent.clear()
        window.append(sorted(thinned(taken, VALUES_PER_SAMPLE)))
        out = percentiles(itertools.chain.from_iterable(window))
        return {k: (v if k == "n" or v is None else round(v * 1000.0, 2)) for k, v in out.items()}

    def _note_upstream(self, sample: Sample) -> None:
        up = sample["upstream"]
        now = (str(up["state"]), int(up["restarts"]))
        if now != self._upstream:
            restarted = self._upstream is not None and now[1] > self._upstream[1]
            self.history.add_event(Event(
                sample["id"], sample["t"], now[0], now[1], up["last_restart_reason"] if restarted else None,
            ))
            self._upstream = now


def _summed(by_label: dict[str, float]) -> dict[str, float]:
    total = sum(by_label.values())
    return {"": round(total, 3)} if total else {}
