"""Lateness: the queued requests already known to miss the TTFT objective that judged them as they arrived, and the
arrivals the pace's cap would hold past theirs; each refused at once with 503 ``deadline`` and a ``Retry-After``.

An objective (the operator's ``--ttft-objective SECONDS``, or the one derived while an overload is sustained) judges a
request as it arrives against a forecast of its wait. Forecasts err when the engine slows under them, and a request
served past its objective is one the objective did not hold for. So the queue is also judged on what is *known*: a
queued request whose wait so far and the engine's time to a first token now (``Deadlines.late``) pass its objective
is refused on the next pass over the queue rather than served late; the refusal comes within the objective, while a
retry can still help. A request the llm-d router's objective alone judged waits on, as that header promises. Under a
sustained overload with no objective of the operator's, a queued request (most of them queued before the overload
was seen: no objective judged them) is refused on an arrival's pass once its first token would come past twice the
derived objective (``Deadlines.backlog_bound``): requests go on arriving behind it, and a finite burst's stragglers,
with none behind them, are served. That holds for the surge's first requests too, queued before any backlog: at three
times the engine's capacity into 256 blocks the onset's longest wait fell from 6.0 s to 3.2-3.9 s with them refused so
(docs/realistic.md). An arrival refused at once counts as one arriving (``Admission.arrive``): into 1,024 blocks vLLM's
own queue took every arrival's whole wait, so none was queued and none made a pass, while the onset's queue waited
4.4-7.0 s.

While the pace's cap binds (``pace``), the KV forecast sees free blocks and would queue every arrival: the wait is
then set by the requests that end, one admission each. An arrival is refused when its turn, at the rate requests
left the gateway over the last minute, comes past ``ARRIVAL_SHARE`` of the time it may wait, as the KV forecast
refuses (``forecast``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, TypeVar

from gateway import errors
from gateway.admission.deadlines import Deadlines, WaitLimit
from gateway.admission.forecast import ARRIVAL_SHARE
from gateway.admission.queue import Drain, Waiting, WaitQueue
from gateway.admission.refusals import SUSTAINED


class Queued(Waiting, Protocol):
    """A waiting request, as the queue reads it, and the limit its wait was judged by."""

    @property
    def wait_limit(self) -> WaitLimit | None: ...


Q = TypeVar("Q", bound=Queued)


def late_requests(
    queue: WaitQueue[Q], deadlines: Deadlines, drain: Drain, in_flight: int, now: float, arriving: Q | None,
) -> Iterator[tuple[Q, errors.DeadlineUnreachable]]:
    """The queued requests to refuse now, each with its refusal; ``arriving``: the request just arrived (queued, and
    judged on its turn under the pace's cap rather than on its wait, or refused at once and not in the queue)."""
    if deadlines.objective is None and not deadlines.sustained.sustained:
        return
    engine = deadlines.engine_seconds(in_flight)
    whose = f" {SUSTAINED}" if deadlines.objective is None else ""  # the derived objective, else the operator's
    bound = deadlines.backlog_bound() if arriving is not None else None  # requests go on arriving behind them
    for r in list(queue):
        limit = r.wait_limit
        if r is arriving or limit is None:
            continue
        waited = now - queue.enqueued_at(r)
        if limit.objective is None:
            if bound is not None and waited + engine > bound:
                yield r, errors.DeadlineUnreachable(
                    f"Waited {waited:.1f} s in the queue; with the engine's {engine:.1f} s to a first "
                    f"token now, its first token would come past {bound:.1f} s, "
                    f"twice the objective derived {SUSTAINED}, while requests go on arriving; retry later.",
                    retry_after=drain.retry_after(queue.position(r), now),
                )
        elif deadlines.late(limit, waited, engine):
            retry_after = drain.retry_after(queue.position(r), now)
            yield r, errors.DeadlineUnreachable(
                f"Waited {waited:.1f} s in the queue; with the engine's {engine:.1f} s to a first token now, its "
                f"first token would come past the TTFT objective of {limit.objective:.1f} s"
                f"{whose}; retry later.",
                retry_after=retry_after,
            )
    yield from _held_by_the_cap(queue, deadlines, drain, in_flight, now, arriving, whose)


def _held_by_the_cap(
    queue: WaitQueue[Q], deadlines: Deadlines, drain: Drain, in_flight: int, now: float, arriving: Q | None,
    whose: str,
) -> Iterator[tuple[Q, errors.DeadlineUnreachable]]:
    """The arrival, when the pace's cap would hold it past the time it may wait: an objective judged it, or the wait
    derived under a sustained overload (the pace then holds the backlog's bound)."""
    limit = arriving.wait_limit if arriving is not None else None
    if arriving is None or limit is None or not deadlines.pace.binds(in_flight):
        return
    if limit.objective is not None:
        within = f"the TTFT objective of {limit.objective:.1f} s{whose}"
    elif limit.derived and (bound := deadlines.backlog_bound()) is not None:
        within = f"{bound:.1f} s, twice the objective derived {SUSTAINED},"
    else:
        return
    rate = drain.rate(now)
    if rate is None or arriving not in queue:
        return
    position = queue.position(arriving)
    turn = (position + 1) / rate
    if turn > ARRIVAL_SHARE * limit.seconds:
        yield arriving, errors.DeadlineUnreachable(
            f"Expected wait {turn:.1f} s for one of the {deadlines.pace.cap} requests the engine runs at once within "
            f"{within} exceeds {ARRIVAL_SHARE:.0%} of the {limit.seconds:.1f} s the request may wait "
            f"({position} ahead of it, {rate:.1f} requests end a second); retry later.",
            retry_after=drain.retry_after(position, now),
        )
