"""Deadlines: how long a request may wait in the gateway's queue, given when its client wants a first token.

A request's own deadline is the earliest of what its client says (``x-guard-deadline-ms``, or the OpenAI SDKs'
``x-stainless-read-timeout``: a client that gives up at 30 s gains nothing from a first token at 31 s), its own TTFT
objective (the llm-d router's ``x-llm-d-slo-ttft-ms``), and the operator's ``--ttft-objective SECONDS``, or, by
default (``auto``), the objective the gateway derives while an overload is sustained (``sustained``). Its first
token comes after its wait in the queue *and* the engine's own time to a first token once admitted (prefill queued
ahead of it inside the engine, and the steps of the batch it joins), so the queue may hold it for its deadline less
that engine time, and never past ``--queue-timeout``.

The engine's time to first token is learned from the streams the gateway relays: from a request's write to its
engine to its first streamed token (``FirstTokens``; a non-streamed answer reports its tokens only at the end, and
is not a sample), over the last ``WINDOW_SECONDS``, at its ``QUANTILE`` (most admitted requests must make their
deadline, not the average one). It is used only while requests are in flight: an idle engine's figure is its
prefill alone, and a figure learned under a load that has gone would otherwise refuse requests it can serve.

A request whose deadline leaves it no time to wait is refused as it arrives (503 ``deadline``), and one forecast
to wait past it is refused at once by the forecast (``forecast``), with a computed ``Retry-After``. An objective
(the request's own, the operator's or the derived one) is an aim rather than the client's deadline: it judges a
request only as it arrives, and one it queued waits on, within the client's own deadline and ``--queue-timeout``
(``WaitLimit.then``), so that every refusal an objective makes comes at arrival. One that reaches the client's
own deadline in the queue gets the same 503: a busy engine missed it, and later, less busy, it may not. A deadline
below ``MIN_DEADLINE_SECONDS`` is another matter: no engine meets it, busy or idle, so it is the client's mistake,
refused as the request is read (400 naming the header and this floor), not a 503 that the OpenAI SDKs would retry
in vain.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Final, Protocol

from gateway.admission.engine_wait import EngineQueueWait
from gateway.admission.ordered import OrderedFloats
from gateway.admission.pace import Pace
from gateway.admission.sustained import SustainedOverload

WINDOW_SECONDS = 10.0
MIN_SAMPLES = 4
QUANTILE = 0.9
# The shortest deadline a client may give (seconds to a first token). A fixed floor rather than the engine's
# learned time to a first token: that time depends on the prompt and on the load, and a 400 must hold for the
# request whatever the engine's state (a client error is not retried), while no engine ever answers within a
# millisecond: the round trip to it and one step of its model take longer, and vLLM's own API server adds
# milliseconds before either. Deadlines above it that a busy engine misses stay 503 with Retry-After.
MIN_DEADLINE_SECONDS = 0.001
UNQUEUED_SAMPLES = 64  # requests admitted as they arrived, whose first tokens say what the engine takes unhurried
# Of ours awaiting a first token, per engine, past which a request admitted is not a sample of the engine's unhurried
# time (``Deadlines.crowded``).
UNHURRIED_AHEAD = 4

log = logging.getLogger(__name__)


class Deadlined(Protocol):
    @property
    def deadline(self) -> float | None: ...

    @property
    def objective(self) -> float | None: ...


class WaitLimit:
    """How long a request may wait in the queue, and whether its own deadline (rather than ``--queue-timeout``)
    sets that. Never changed once built (``but`` makes a changed copy).

    A plain class, not a frozen dataclass: one is built for every arrival, and a dataclass's ``__init__`` is not
    compiled by mypyc (``gateway/native.py``): it ran as Python, each field set through ``object.__setattr__``,
    11,500 instructions a request of an admission's 138,700 (callgrind, an arrival and its release in-process);
    compiled, with its fields ``Final``, it is a native constructor."""

    def __init__(
        self, seconds: float, own: bool, engine_seconds: float, derived: bool = False, backlogged: bool = False,
        then: WaitLimit | None = None, objective: float | None = None, engine_queue: float = 0.0,
    ) -> None:
        self.seconds: Final = seconds
        self.own: Final = own
        self.engine_seconds: Final = engine_seconds  # the engine's time to a first token it allows for
        # The objective the gateway derives under a sustained overload sets it (``sustained``).
        self.derived: Final = derived
        # It arrived while a request queued before it had waited past the derived wait.
        self.backlogged: Final = backlogged
        # Where an objective (the request's own, the operator's or the derived one) sets the wait, the limit that
        # holds once the request is queued: the client's own deadline or ``--queue-timeout``. None: this one holds
        # throughout.
        self.then: Final = then
        # The operator's objective, or the derived one, that judged it as it arrived: once queued it is refused as
        # soon as its wait so far and the engine's time to a first token now pass it (``Deadlines.late``). None: no
        # such.
        self.objective: Final = objective
        # Under a sustained overload, the wait ahead in the engine's own queue that was taken from the derived wait.
        self.engine_queue: Final = engine_queue

    def but(self, *, backlogged: bool, then: WaitLimit | None, objective: float | None) -> WaitLimit:
        """A copy with these three set (each given, changed or not)."""
        return WaitLimit(self.seconds, self.own, self.engine_seconds, self.derived, backlogged, then, objective,
                         self.engine_queue)

    @property
    def queued(self) -> WaitLimit:
        """The limit that holds once the request is queued."""
        return self.then if self.then is not None else self

    def __repr__(self) -> str:
        return (f"WaitLimit(seconds={self.seconds!r}, own={self.own!r}, engine_seconds={self.engine_seconds!r}, "
                f"derived={self.derived!r}, backlogged={self.backlogged!r}, then={self.then!r}, "
                f"objective={self.objective!r}, engine_queue={self.engine_queue!r})")


class FirstTokens:
    """The engine's time from a request's write to it to a first token, over the requests admitted lately; and,
    apart, over the last ``UNQUEUED_SAMPLES`` requests admitted as they arrived into an engine with none of its own
    waiting (nothing kept them waiting: the engine was not overloaded), whenever that was.

    The window's samples are also kept sorted, so that its quantile is read, not computed: it is read on every
    engine snapshot and live-page sample, and at 1,500 streams a second the window holds 15,000 samples, whose
    sort took ~2 ms each time on the loop; ``OrderedFloats`` keeps them in chunks, so that an insertion or a removal
    moves one chunk's values whatever the rate."""

    def __init__(self, clock: Callable[[], float], window: float = WINDOW_SECONDS) -> None:
        self._clock = clock
        self._window = window
        self._samples: deque[tuple[float, float]] = deque()
        self._sorted = OrderedFloats()  # the window's seconds, in order (as many as first tokens in the window)
        self._unqueued: deque[float] = deque(maxlen=UNQUEUED_SAMPLES)
        self._unqueued_sorted: list[float] = []  # the same, in order (a sort of them all was 2.4 us a sample)
        self._unqueued_quantile: float | None = None  # read on every arrival: computed once per sample

    def add(self, seconds: float, queued: bool = False) -> None:
        now = self._clock()
        seconds = max(0.0, seconds)
        self._samples.append((now, seconds))
        self._sorted.add(seconds)
        self._prune(now)
        if not queued:
            unqueued, ordered = self._unqueued, self._unqueued_sorted
            if len(unqueued) == unqueued.maxlen:  # the oldest leaves as this one comes
                del ordered[bisect.bisect_left(ordered, unqueued[0])]
            unqueued.append(seconds)
            bisect.insort(ordered, seconds)
            self._unqueued_quantile = _quantile_of_sorted(ordered)

    def estimate(self) -> float | None:
        """The ``QUANTILE`` of the window's samples; None with fewer than ``MIN_SAMPLES``."""
        self._prune(self._clock())
        ordered = self._sorted
        return ordered.at(_quantile_index(len(ordered))) if len(ordered) >= MIN_SAMPLES else None

    def unqueued(self) -> float | None:
        """The ``QUANTILE`` of the engine's time when not overloaded; None with fewer than ``MIN_SAMPLES``."""
        return self._unqueued_quantile

    def _prune(self, now: float) -> None:
        samples, ordered = self._samples, self._sorted
        while samples and samples[0][0] < now - self._window:
            _, seconds = samples.popleft()
            ordered.remove(seconds)


def _quantile_index(count: int) -> int:
    """Where the ``QUANTILE`` of ``count`` values in order is."""
    return min(count - 1, math.ceil(QUANTILE * count) - 1)


def _quantile_of_sorted(ordered: Sequence[float]) -> float | None:
    if len(ordered) < MIN_SAMPLES:
        return None
    return ordered[_quantile_index(len(ordered))]


class Deadlines:
    def __init__(
        self, queue_timeout: float, objective: float | str | None, clock: Callable[[], float], *,
        feedback: bool = False,
    ) -> None:
        """``objective``: the operator's seconds, ``"auto"`` (derived under a sustained overload) or ``"off"``;
        ``feedback`` (``--sustained-feedback on``): the derived objective is held as the operator's is, on what
        happened (a queued request refused once known late, the pace), and the overload stays sustained while
        arrivals are refused; off, it judges arrivals only."""
        self.queue_timeout = queue_timeout
        self._plain = WaitLimit(queue_timeout, False, 0.0)  # ``_limit``'s usual answer
        self.objective = objective if isinstance(objective, int | float) else None
        self.feedback = feedback
        self.sustained = SustainedOverload(enabled=objective == "auto", refusals_count=feedback)
        self.first_tokens = FirstTokens(clock)
        self.pace = Pace()
        self._clock = clock
        # The wait in the engines' own queues, followed on every snapshot (``_follow_engine_queue``).
        self.engine_queue = EngineQueueWait()
        self._streaming = 0  # admitted requests whose first token was timed, not ended yet
        self._told = False  # the operator was told that it passed the derived wait, in this sustained overload

    def engine_seconds(self, in_flight: int) -> float:
        """The engine's time to a first token to allow for now (0 while it runs nothing of ours)."""
        return (self.first_tokens.estimate() or 0.0) if in_flight else 0.0

    def limit(self, r: Deadlined, in_flight: int, oldest_wait: float = 0.0) -> WaitLimit:
        """How long ``r`` may wait; ``oldest_wait``: how long the first of those queued before it has waited."""
        limit = self._limit(r, in_flight)
        backlogged = oldest_wait > self.sustained.wait(self.unhurried())
        if backlogged and limit.seconds > 0:  # queued (refused at once otherwise)
            self.sustained.arrived_into_backlog(r, self._clock())
        if not backlogged and limit.then is None and not limit.backlogged:
            return limit  # the usual case, as it is: no copies made on every arrival
        then = limit.then.but(backlogged=backlogged, then=limit.then.then, objective=limit.objective) \
            if limit.then else None
        return limit.but(backlogged=backlogged, then=then, objective=limit.objective)

    def _limit(self, r: Deadlined, in_flight: int) -> WaitLimit:
        # The request's own objective and the operator's are both aims: the earlier of them judges its arrival.
        own = [d for d in (r.deadline, r.objective, self.objective) if d is not None]
        derived = self.sustained.applies(self._clock())
        if not own and not derived:  # the usual case: the same limit for every arrival, built once
            plain = self._plain
            if plain.seconds != self.queue_timeout:
                plain = self._plain = WaitLimit(self.queue_timeout, False, 0.0)
            return plain
        engine = self.engine_seconds(in_flight)
        allowed = min(own) - engine if own else math.inf
        # An objective is the gateway's aim, not the client's deadline: it judges a request as it arrives (refused
        # at once when forecast to miss it), and a request it queued is served however long it then waits, within
        # the client's own deadline and the queue timeout. Refused at the end of its wait instead, it would have
        # waited seconds for a 503 (p99 4.3 s after arrival with --ttft-objective 5,
        # docs/history/realistic-default-objective.md) where the engine could still serve it, a little late.
        client = r.deadline - engine if r.deadline is not None else math.inf
        then = WaitLimit(client, True, engine) if client < self.queue_timeout else WaitLimit(
            self.queue_timeout, False, engine)
        # The derived wait is not cut by the engine's time now: that time is held within it (``compute_room``).
        aims = [self.objective] if self.objective is not None else []
        if derived and (wait := self.sustained.wait(self.unhurried())) < allowed:
            # The engine's own queue is the front of the gateway's: a request waits the derived wait in both
            # together, and one admitted into a queue in vLLM that is already that long is refused at once.
            ahead = self.engine_queue.ahead(self._clock())  # past the wait: no time left, refused at arrival
            limit = WaitLimit(min(wait - ahead, self.queue_timeout), True, engine, derived=True, engine_queue=ahead)
            aims += [self.sustained.objective(self.unhurried())] if self.feedback else []
        elif allowed < self.queue_timeout:
            limit = WaitLimit(allowed, True, engine)
        else:
            return WaitLimit(self.queue_timeout, False, engine)
        objective = min(aims, default=None)
        return limit.but(backlogged=limit.backlogged, then=then if then.seconds > limit.seconds else None,
                         objective=objective)

    def objective_now(self) -> float | None:
        """The objective every arriving request is held to now: the operator's, else the derived one while an
        overload is sustained; None: none (a burst is queued whole)."""
        if self.objective is not None:
            return self.objective
        held = self.feedback and self.sustained.applies(self._clock())
        return self.sustained.objective(self.unhurried()) if held else None

    def backlog_bound(self) -> float | None:
        """While an overload is sustained (``auto``), the time to a first token past which a queued request is refused
        on an arrival's pass (``SustainedOverload.late_bound``); None otherwise."""
        if self.objective is not None or not self.sustained.applies(self._clock()):
            return None
        return self.sustained.late_bound(self.unhurried())

    @staticmethod
    def late(limit: WaitLimit | None, waited: float, engine: float) -> bool:
        """Whether a request queued ``waited`` seconds ago under ``limit`` is known to miss the objective that judged
        it: its wait so far and the engine's time to a first token now (``engine_seconds``) pass it."""
        return limit is not None and limit.objective is not None and waited + engine > limit.objective

    def first_token(self, seconds: float, *, waited: float, queued: bool, limit: WaitLimit | None) -> None:
        """A request admitted after waiting ``waited`` seconds under ``limit`` streamed its first token ``seconds``
        after its admission; ``queued``: it waited for a release, or was admitted as it arrived into an engine with
        requests waiting in its own queue (rather than into an engine that took it at once)."""
        # While an overload is sustained, a request admitted as it arrived still joins a full engine: its time is the
        # load's, not the engine's unhurried one, and the derived wait resting on it would drift up with the load.
        self.first_tokens.add(seconds, queued=queued or (self.feedback and self.sustained.sustained))
        self.engine_queue.departed(self._clock())
        self._streaming += 1
        self.pace.first_token(self._clock(), waited, seconds, limit.objective if limit is not None else None)

    def left_engine(self, *, timed: bool) -> None:
        """An admitted request ended; ``timed``: its first token was timed (``first_token``), which counted when it
        left the engine's queue. One that was not (a whole answer, one cut before its first token) left it by now."""
        if not timed:
            self.engine_queue.departed(self._clock())
        else:
            self._streaming = max(0, self._streaming - 1)

    def steer(self, in_flight: int, queued: bool, engine_waiting: int | None, engine: int = 0) -> None:
        """Tighten or loosen the pace's cap on the requests in flight, and follow the engines' own queues (on every
        engine snapshot)."""
        now = self._clock()
        # Of those waiting in the engine's queue, ours are at most those in flight without a first token yet: a
        # queue of requests sent around the gateway (or left behind by clients gone) is not our requests' wait, and
        # with their count over our departures Little's law read 8.6 s where ours waited 0.01 s (256 blocks, an
        # engine that vLLM alone had just overloaded: docs/realistic.md).
        self.engine_queue.snapshot(now, engine, min(engine_waiting or 0, max(0, in_flight - self._streaming)))
        if self.sustained.enabled:
            self._follow_engine_queue(now)
        self.pace.step(now, self.pace_objective(), in_flight, queued, engine_waiting or 0)

    def pace_objective(self) -> float | None:
        """The objective the pace holds the admitted to now (its cap keeps the engine's own time within half of it):
        the one every arrival is held to (``objective_now``), else, while an overload is sustained under ``auto``, the
        backlog's bound (``backlog_bound``), half of which is the derived objective. Where the cache lets a
        compute-bound engine take as many requests as it holds (1,024 blocks at 2x and 3x its capacity), the gateway's
        queue stayed nearly empty and the engine's own time to a first token sat at 2.3-4.6 s (0.9 quantile) under a
        derived objective of 2 s: the wait was held, the engine's time was not (docs/realistic.md). Where the cache
        binds first (256 and 512 blocks) the engine's time stays at 0.2-0.9 s and the cap never falls."""
        objective = self.objective_now()
        return objective if objective is not None else self.backlog_bound()

    def _follow_engine_queue(self, now: float) -> None:
        """See a sustained overload in the engines' own queues as well as in the gateway's.

        Where the engine's prefill binds before its cache (1,024 blocks at twice capacity), KV room admits every
        arrival into vLLM's own queue: the gateway's stays empty, nothing that watches it sees the overload, and
        first tokens climbed to 6-8 s over its first ten seconds (docs/realistic.md). So the mean wait in the
        engines' queues (``engine_wait``) past the derived wait makes the overload sustained, as a request that
        waited so in the gateway's queue does; and while a request admitted now would wait half of it there or more,
        the overload is not calm for the gateway's queue being empty (ended so, it was seen again only seconds into
        the next climb). While it is sustained, the wait ahead in vLLM's queue comes off the derived wait
        (``_limit``): an arrival whose whole wait that queue takes is refused at once."""
        wait, waited = self.sustained.wait(self.unhurried()), self.engine_queue.seconds(now)
        begins = waited is not None and waited > wait
        if begins or self.engine_queue.ahead(now) >= wait / 2:
            self.sustained.engine_backlog(now, begins=begins)
        if not self.sustained.applies(now):
            self._told = False
        elif begins and not self._told:
            self._told = True
            log.warning(
                "requests waited %.2f s on average in the engine's own queue, past the %.2f s an arriving request may "
                "wait under a sustained overload (--ttft-objective auto): the engine's prefill, not its KV cache, "
                "binds; arrivals are refused while that queue holds their whole wait", waited, wait)

    def crowded(self, in_flight: int, engines: int = 1) -> bool:
        """Whether a request admitted now joins more of ours awaiting their first token than ``UNHURRIED_AHEAD`` an
        engine: its first token then comes after their prefills, not in the engine's unhurried time, though nothing
        waits in the engine's own queue. Where the cache lets a compute-bound engine take a surge's first hundred
        requests at once (1,024 blocks at 3x its capacity), vLLM's queue was empty while they all prefilled together,
        their first tokens came 3-5 s after admission, and taken for the unhurried time they set the derived wait at
        2.8-4.4 s, its objective at 5.6-8.7 s (docs/realistic.md). Those admitted ahead of such a crowd are served
        first (vLLM schedules prefills in arrival order) and still tell the unhurried time."""
        return in_flight - self._streaming > UNHURRIED_AHEAD * max(1, engines)

    def unhurried(self) -> float:
        """The engine's time to a first token when not overloaded (0 before any was seen)."""
        return self.first_tokens.unqueued() or 0.0

    def left_queue(self, r: Deadlined, waited: float, limit: WaitLimit | None) -> None:
        """``r`` left the queue, admitted or at its deadline, after ``waited`` seconds (``limit``: the one it was
        queued with)."""
        self.sustained.left_queue(r, waited, self.unhurried(), backlogged=limit is not None and limit.backlogged)

    def refused(self) -> None:
        """A request was refused (at arrival or from the queue)."""
        self.sustained.refused(self._clock())

    def queue(self, waiting: bool, now: float) -> None:
        """Whether requests wait in the queue, as of ``now`` (after every pass over it)."""
        self.sustained.queue(waiting, now, self.unhurried)

    def compute_room(self, in_flight: int) -> bool:
        """Whether the engine's steps leave room for more work within the objective: its time to a first token
        now is within half the operator's objective, or, once an overload is sustained under ``auto``, within the
        wait it allows (a fuller batch runs each step slower; room in the cache is not time in the engine)."""
        engine = self.engine_seconds(in_flight)
        if self.objective is not None:
            return engine <= self.objective / 2
        if self.sustained.applies(self._clock()):
            return engine <= self.sustained.wait(self.unhurried())
        return True

    def status(self) -> dict[str, float | bool | str | None]:
        estimate, unhurried = self.first_tokens.estimate(), self.first_tokens.unqueued()
        derived = self.sustained.objective(self.unhurried()) if self.sustained.enabled else None
        return {
            "ttft_objective": "auto" if self.sustained.enabled else "off" if self.objective is None else "seconds",
            "ttft_objective_s": self.objective if derived is None else round(derived, 3),
            "sustained_overload": self.sustained.applies(self._clock()),
            "engine_queue_wait_s": None if (waited := self.engine_queue.seconds(self._clock())) is None else round(
                waited, 3),
            "engine_first_token_s": None if estimate is None else round(estimate, 3),
            "engine_first_token_unqueued_s": None if unhurried is None else round(unhurried, 3),
            **{f"pace_{k}": v for k, v in self.pace.status().items()},
        }
