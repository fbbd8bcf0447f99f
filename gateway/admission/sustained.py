"""The TTFT objective the gateway derives when the operator sets none (``--ttft-objective auto``, the default), and
when it holds: only while an overload is *sustained*.

A queue serves two purposes that pull apart. Under a finite burst (16 long requests at once on an engine that
runs two of them at a time) it holds the burst while the engine works through it, and a client that said
nothing of its patience gets its answer as it would from the engine alone, however long that takes. Under a
sustained overload (requests keep arriving faster than the engine finishes them) a long queue adds nothing: the
engine is full either way, each request waits the whole queue out, and what is served comes late (with 30-s
clients and no objective, the first tokens came at 13-30 s). There the queue only needs to hold enough to keep
the engine fed; the rest is refused at once, while a retry elsewhere can still help.

The two look alike at first (a queue that builds); they part once requests keep arriving into a queue that has
held requests a while: the overload is **sustained** once a request that *arrived into a backlog* (one queued
before it had waited past the derived wait, below) has waited past that wait itself, in the queue or on leaving
it (admitted, refused or withdrawn), and stays so until the queue has stayed empty for ``CALM_SECONDS`` (a queue
that empties at each release and fills again at the next arrival is still the same overload). With
``--sustained-feedback on`` nobody may have been refused meanwhile either: an empty queue because every arrival is
refused at once is the same overload too (ended by that, the overload was seen again only once requests queued with
their clients' deadlines had waited into it, and those were served late).
A burst that arrives at once is queued whole before that happens, and so are its stragglers: vLLM's benchmark
client sent 2 of a burst of 16 long requests 3.5 s after the others, just after the first were admitted having
waited 3.5 s, and the rule that took any late departure for a sustained overload refused those two. The first
requests of a sustained overload are queued too, and at three times the engine's capacity they are many: when the
overload was seen (2-3 s in, 256 blocks, docs/realistic.md) the queue held 150-250 requests, which waited up to 6-10 s
(72, 26 and 46 of a turn's admitted past 5 s), and every arrival of the next seconds was refused at once behind them.
So once it is sustained, each arrival's pass also refuses the queued requests whose wait so far and the engine's time
to a first token now pass twice the derived objective (``late_bound``, 4 s at the floor; ``lateness``), whether they
arrived into a backlog or before one (the surge's first second: at 256 blocks those waited up to 6.0 s): requests go
on arriving behind them that the engine can serve in time. A burst's stragglers are refused so only if requests go on
arriving after them: a finite burst sends none, and is served whole.
From then on an arriving request may wait in the queue

    the engine's *unhurried* time to a first token (at least ``MIN_WAIT_SECONDS``)

where unhurried is the 0.9 quantile of the last requests admitted as they arrived, whose first tokens came while
nothing waited in the queue (``deadlines.FirstTokens.unqueued``), nor in the engine's own: a request admitted as it
arrived while the engine's last snapshot showed requests waiting in it (``vllm:num_requests_waiting``) was queued
there, and its first token is the load's (``Reservation.queued_anywhere``). With a cache large enough that the
engine's prefill binds before its blocks do (1,024 blocks at twice capacity, docs/realistic.md), the gateway admits
on KV room into vLLM's growing queue; taken for unhurried, those first tokens grew the wait with the load, the
overload was seen 19 s in and first tokens stayed at 5-8 s after it; left out, 93-99% of the admitted had their
first token within 5 s (34-82% before) at 1.5-2.7x the goodput. The engine's time *now* is held to the
same bound the other way: while it is longer than the wait, the adaptive policy's reach past its preemption
budget is taken away (``Deadlines.compute_room``), so the batch stops growing and its steps speed up. An admitted
request so gets its first token within about twice the wait: the derived objective. Like the operator's, it judges
a request as it arrives: one it queued waits on past the wait if the engine slows (``deadlines.WaitLimit.then``).
The engine's time now is not the basis, though it is what a request admitted now will take: it grows as the batch
fills and every step slows, the very thing the reach does under an overload, and a wait that grew with it would let
the queue and the batch grow together (and make the bound on the engine's time always hold). The unhurried time is
mostly a property of the engine and the prompts, not of the load, though requests admitted as they arrived into an
engine already filling (with nothing yet waiting in it) count too. Measured on vLLM's CPU build under the realistic
benchmark's sustained overload (16 streams/s, docs/history/realistic-default-objective.md): the unqueued time 0.09 s
at the start, 0.6-1.06 s once the engine filled; the time now 0.6-1.0 s while the overload was sustained. So there
the wait was the floor (1.06 s at most) whichever it rested on, and the choice rests on the argument above, which
those runs could not tell apart. The clients' own deadlines still apply, whichever comes first; they are no basis
for the objective, since most clients say nothing (vLLM's benchmark client) or give minutes (the OpenAI SDKs:
600 s).

vLLM's own queue counts as the front of the gateway's. With a cache large enough that the engine's prefill binds
before its blocks do, KV room admits every arrival into vLLM's queue: the gateway's stays empty and the overload went
unseen for its first ten seconds while first tokens climbed to 6-8 s (1,024 blocks at twice capacity,
docs/realistic.md). So the mean wait in the engines' queues over the last seconds (``engine_wait``: Little's law on
their snapshots' waiting counts) past the wait makes the overload sustained too, a wait ahead there of half the wait
keeps it from calm (``engine_backlog``), and while it is sustained the wait ahead in vLLM's queue comes off the wait an
arriving request may have in the gateway's (``Deadlines._limit``): one whose whole wait vLLM's queue takes is refused
at once. There the admitted then had 98-100% of their first tokens within 5 s (68-95% before) at 1.09-1.43x the
goodput; where the cache binds first vLLM's queue holds a request hundredths of a second and nothing changes.

The floor keeps the queue deep enough to feed an engine whose first tokens come fast (a GPU's take tens of
milliseconds): a second of releases covers many admissions. The operator's ``--ttft-objective SECONDS`` holds
for every request at all times; ``off`` leaves only ``--queue-timeout`` and the clients' deadlines.
"""

from __future__ import annotations

import math
from collections.abc import Callable

MIN_WAIT_SECONDS = 1.0
ENGINE_MULTIPLE = 1.0  # of the engine's unhurried time to a first token, that a request may wait
CALM_SECONDS = 1.0  # of an empty queue, that end a sustained overload
# Of the derived objective: past it a queued request is refused from the queue, once the overload
# is sustained and requests go on arriving behind it (``SustainedOverload.late_bound``).
BACKLOG_MULTIPLE = 2.0


class SustainedOverload:
    """Whether the overload is sustained, and the wait the derived objective allows an arriving request then."""

    def __init__(self, enabled: bool, refusals_count: bool = False) -> None:
        """``refusals_count``: a refusal while sustained keeps the queue from being calm (``--sustained-feedback``)."""
        self.enabled = enabled
        self._refusals_count = refusals_count
        self.sustained = False
        self._empty_since: float | None = None  # when the queue last became empty; None while requests wait
        self._refused_at = -math.inf  # when a request was last refused while the overload was sustained
        self._engine_backlog_at = -math.inf  # when the engines' own queues last held requests past the wait
        # Requests now waiting that arrived into a backlog, with when each arrived (in arrival order).
        self._backlogged: dict[object, float] = {}

    @staticmethod
    def wait(unhurried: float) -> float:
        """Seconds an arriving request may wait in the queue under a sustained overload, given the engine's
        unhurried time to a first token."""
        return max(MIN_WAIT_SECONDS, ENGINE_MULTIPLE * unhurried)

    def objective(self, unhurried: float) -> float:
        """The derived objective: the wait in the queue, and as long again at most in the engine."""
        return 2 * self.wait(unhurried)

    def late_bound(self, unhurried: float) -> float:
        """The time to a first token past which a queued request is refused from the queue while
        the overload is sustained and requests go on arriving: twice the derived objective (4 s at the floor)."""
        return BACKLOG_MULTIPLE * self.objective(unhurried)

    def applies(self, now: float) -> bool:
        """Whether an arriving request is held to the derived objective now."""
        calm = self._empty_since is not None and now - max(
            self._empty_since, self._refused_at, self._engine_backlog_at) >= CALM_SECONDS
        if self.sustained and calm:
            self.sustained = False
        return self.enabled and self.sustained

    def refused(self, now: float) -> None:
        """A request was refused at ``now``: while the overload is sustained, the queue is not calm for being empty
        (every arrival may be refused at once into an empty queue while the engine is full)."""
        if self.sustained and self._refusals_count:
            self._refused_at = now

    def engine_backlog(self, now: float, *, begins: bool) -> None:
        """The engines' own queues hold requests long at ``now``: the overload is not calm for the gateway's queue
        being empty (KV room admits requests into vLLM's queue instead); ``begins``: they held them past the wait on
        average lately, which makes it sustained (requests keep arriving into a queue that held them past the wait,
        the engine's rather than the gateway's)."""
        if not self.enabled:
            return
        self._engine_backlog_at = now
        if begins:
            self.sustained = True

    def arrived_into_backlog(self, key: object, now: float) -> None:
        """The request ``key`` was queued at ``now`` while one queued before it had waited past the wait already."""
        if self.enabled:
            self._backlogged[key] = now

    def left_queue(self, key: object, waited: float, unhurried: float, backlogged: bool) -> None:
        """The request ``key`` left the queue (admitted, refused or withdrawn) after waiting ``waited`` seconds;
        ``backlogged``: it arrived while one queued before it had waited past the wait already."""
        self._backlogged.pop(key, None)
        if self.enabled and backlogged and waited > self.wait(unhurried):
            self.sustained = True

    def queue(self, waiting: bool, now: float, unhurried: Callable[[], float]) -> None:
        """Whether requests wait in the queue, as of ``now`` (after every pass over it). A request that arrived
        into a backlog and has been waiting past the wait makes the overload sustained then, not when it leaves:
        at twice the engine's capacity the first of them left 12-13 s into a surge, the queue growing meanwhile.
        ``unhurried`` (a quantile: a sort) is asked only while such a request waits, not on every pass."""
        if waiting:
            self._empty_since = None
            first = next(iter(self._backlogged.values()), None)
            if first is not None and now - first > self.wait(unhurried()):
                self.sustained = True
        elif self._empty_since is None:
            self._empty_since = now
