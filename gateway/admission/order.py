"""The order that cuts waiting: within a priority and a tenant's fair share, the request with the least expected
work goes first, aged so that none waits much past its turn.

A request's expected work is the tokens the engine must compute for it: its prompt less the tokens the engine holds
cached for it (the prefix blocks a request in flight holds, or one that ended lately left, on the engine that holds
most of them), plus its expected output (``lengths``, at the booking quantile; its ``max_tokens`` at the worst
case) for each of its ``n`` sequences. Serving the shortest first cuts the mean wait (shortest-job-first);
taken alone it would starve the long ones, so a request's place in the queue is its arrival pushed back by
``SECONDS_PER_TOKEN`` per token of work, at most ``MAX_SHIFT_SECONDS`` and at most ``DEADLINE_SHARE`` of the wait
it may have: a long request is passed only by requests arriving within that shift of it, never by later ones,
and never for long enough to miss its deadline for it. Priorities still come first, and tenants still take turns
by their fair shares (``queue``, ``fairness``).

Only the default policy orders so; ``strict`` keeps arrival order.
"""

from __future__ import annotations

from collections.abc import Iterable

from gateway.admission.reservation import Reservation
from gateway.admission.site import Site

SECONDS_PER_TOKEN = 1.0 / 2000  # 2,000 tokens of work count as arriving one second later
MAX_SHIFT_SECONDS = 2.0
DEADLINE_SHARE = 0.25


def expected_work(prompt_tokens: int, cached_tokens: int, expected_output: int, n: int) -> int:
    """Tokens the engine computes for a request: its uncached prompt once, its expected output per sequence."""
    return max(0, prompt_tokens - cached_tokens) + n * expected_output


def shift(work: int, wait_limit: float) -> float:
    """Seconds a request of ``work`` tokens counts as arriving later, for a request that may wait ``wait_limit``."""
    return max(0.0, min(work * SECONDS_PER_TOKEN, MAX_SHIFT_SECONDS, DEADLINE_SHARE * wait_limit))


def queue_shift(r: Reservation, sites: Iterable[Site], block_size: int, wait_limit: float) -> float:
    """The shift of ``r`` as it enters the queue, from what the sites hold of its prompt and the primary's lengths."""
    sites = list(sites)
    cached = max((site.affinity(r) for site in sites), default=0) * block_size
    expected = sites[0].projector.outlook().expected_output(r) if sites else None
    work = expected_work(r.prompt_tokens, cached, r.max_tokens if expected is None else expected, r.n)
    return shift(work, wait_limit)
