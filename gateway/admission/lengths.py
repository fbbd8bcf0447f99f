"""How long answers run: the distribution of real completion lengths, from which the default policy books a
request's expected output rather than its ``max_tokens``.

Lengths are the output tokens per sequence of requests that ran to their end (``Reservation.completed_output``:
the engine's own usage figures where it gives them), kept per *family* (served model and route), per
``max_tokens`` bucket (powers of two: a client that asks for 64 tokens stops differently from one that asks for
4,096, and answers cut at ``max_tokens`` pile up at the bucket's top) and per tenant.

A request is booked at a quantile ``q`` (the preemption controller's to set, ``budget``) of the lengths *longer
than what it has already generated*: a request still running after ``g`` tokens is one of the long ones, and its
booking grows with it as it goes. Past every length seen it is booked at twice what it has generated (at least a
token more), never past ``max_tokens``. ``q = 1`` is the worst case: ``max_tokens``.

Whose lengths: a tenant's own, once it has ``MIN_SAMPLES`` of them in the bucket. Until then, the prior (a
quarter of its ``max_tokens``, ``PRIOR_SHARE``; at least ``PRIOR_MIN`` tokens), raised to the family's figures
(every tenant's lengths together) where those are longer, never lowered by them. Booking a tenant from everyone's
lengths let one tenant skew another's bookings: 40 one-token answers of one tenant made the family's quantile one
token, and another tenant's 1,000-token requests were then booked at a few tokens each (63 blocks admitted against
31, and preemptions). With this rule no sequence of one tenant's answers lowers another tenant's booking below
what that tenant's own history, or the prior, gives (``tests/unit/admission/test_lengths_tenants.py``): another
tenant's lengths can only make a new tenant's first requests book more, and a tenant's own lengths (which it may
skew as it likes) decide its bookings from its ``MIN_SAMPLES``-th answer on, where its skew costs preemptions that
the controller answers by booking everyone closer to the worst case. The prior itself is chosen so: chat clients
ask for far more than they use (the benchmark's answers average 200 tokens of 1,024 asked), booking the worst case
until samples come held half the batch the engine would run, and a prior that proves short costs preemptions that
the controller answers within seconds.

What is known in advance is booked as known: a request that will surely run ``m`` tokens per sequence (``at_least``:
``ignore_eos`` runs to ``max_tokens``, ``min_tokens`` masks EOS and stop strings until then) is booked at least at
``m`` and is taken as still running until then, whatever the lengths say. Answers forced to their ``max_tokens``
so are not learned (``projection.Projector.completed``): they tell nothing of where answers stop.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence

WINDOW = 256  # lengths remembered per bucket: the quantiles follow a change of traffic within minutes
MIN_SAMPLES = 8  # a tenant's own lengths once it has this many in the bucket; the prior (or the family's) before
PRIOR_SHARE = 0.25
PRIOR_MIN = 16

Key = tuple[str, str | None, int]  # (family, tenant or None for the whole family, max_tokens bucket)


def bucket(max_tokens: int) -> int:
    """The power-of-two bucket of ``max_tokens``: 513..1024 share one."""
    return max(0, max_tokens - 1).bit_length()


def prior(max_tokens: int) -> int:
    return min(max_tokens, max(PRIOR_MIN, math.ceil(max_tokens * PRIOR_SHARE)))


class Window:
    """The last ``WINDOW`` lengths, kept in arrival order and sorted."""

    def __init__(self, size: int = WINDOW) -> None:
        self._order: deque[int] = deque()
        self._sorted: list[int] = []
        self._size = size

    def __len__(self) -> int:
        return len(self._order)

    def add(self, tokens: int) -> None:
        if len(self._order) == self._size:
            old = self._order.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._order.append(tokens)
        bisect.insort(self._sorted, tokens)

    def longer_than(self, tokens: int) -> int:
        """How many of the lengths exceed ``tokens``."""
        return len(self._sorted) - bisect.bisect_right(self._sorted, tokens)

    def quantile_past(self, q: float, past: int) -> int | None:
        """The ``q`` quantile of the lengths longer than ``past``; None when none is."""
        first = bisect.bisect_right(self._sorted, past)
        longer = len(self._sorted) - first
        if longer == 0:
            return None
        return self._sorted[first + min(longer - 1, math.ceil(q * longer) - 1 if q > 0 else 0)]


class OutputLengths:
    """Completion lengths seen, by family, tenant and ``max_tokens`` bucket."""

    def __init__(self) -> None:
        self._windows: dict[Key, Window] = {}

    def add(self, family: str, tenant: str, max_tokens: int, tokens: int) -> None:
        b = bucket(max_tokens)
        for key in ((family, None, b), (family, tenant, b)):
            window = self._windows.get(key)
            if window is None:
                window = self._windows[key] = Window()
            window.add(tokens)

    def samples(self, family: str, tenant: str, max_tokens: int) -> int:
        """How many of its own lengths a request of this family, tenant and ``max_tokens`` is booked from (0: the
        prior, raised to the family's figures)."""
        own = self._own(family, tenant, max_tokens)
        return 0 if own is None else len(own)

    def expected(
        self, family: str, tenant: str, max_tokens: int, generated: int, q: float, at_least: int = 0
    ) -> int:
        """Output tokens per sequence to book for a request that has generated ``generated`` per sequence and
        will surely generate ``at_least``."""
        if q >= 1.0:
            return max_tokens
        since = _evidence(generated, at_least)
        own = self._own(family, tenant, max_tokens)
        if own is not None:
            guess = _quantile_or_double(own, q, since)
        else:
            start = prior(max_tokens)
            guess = start if since < start else 2 * since
            family_wide = self._family(family, max_tokens)
            if family_wide is not None:  # may raise the prior, never lower it
                guess = max(guess, _quantile_or_double(family_wide, q, since))
        return min(max_tokens, max(guess, generated + 1, at_least))

    def survival(
        self, family: str, tenant: str, max_tokens: int, generated: int, offsets: Sequence[int], at_least: int = 0
    ) -> list[float]:
        """For a request still running after ``generated`` tokens per sequence, the chance that it is still
        running ``s`` tokens later, for each ``s`` in ``offsets``: the share of the lengths past ``generated``
        that are past ``generated + s``. With no lengths past ``generated`` it is taken to end where ``expected``
        books it (twice what it generated); with too few of its own, where the prior ends it, or later where the
        family's lengths say so (the larger chance at each offset). It surely runs until ``at_least``."""
        since = _evidence(generated, at_least)
        points = [generated + s for s in offsets]
        own = self._own(family, tenant, max_tokens)
        if own is not None:
            alive = _survival(own, max_tokens, since, points)
        else:
            start = prior(max_tokens)
            end = min(max_tokens, start if since < start else max(2 * since, since + 1))
            alive = [1.0 if x < end else 0.0 for x in points]
            family_wide = self._family(family, max_tokens)
            if family_wide is not None:
                alive = list(map(max, alive, _survival(family_wide, max_tokens, since, points)))
        if at_least > generated:
            alive = [1.0 if x < at_least else a for x, a in zip(points, alive, strict=True)]
        return alive

    def _own(self, family: str, tenant: str, max_tokens: int) -> Window | None:
        own = self._windows.get((family, tenant, bucket(max_tokens)))
        return own if own is not None and len(own) >= MIN_SAMPLES else None

    def _family(self, family: str, max_tokens: int) -> Window | None:
        shared = self._windows.get((family, None, bucket(max_tokens)))
        return shared if shared is not None and len(shared) >= MIN_SAMPLES else None

    def status(self) -> dict[str, int]:
        """Lengths held per family and bucket (``family/max_tokens<=2^b``), for ``/guard/status``."""
        return {f"{f}/<={2 ** b}": len(w) for (f, t, b), w in sorted(self._windows.items(), key=str) if t is None}


def _evidence(generated: int, at_least: int) -> int:
    """What a request's progress says of its length: a request still running after ``generated`` tokens is one of
    the answers longer than that, unless it runs only because it must (``at_least``: EOS masked until then), in
    which case its answer, as far as the lengths tell, is any of them."""
    return generated if generated >= at_least else 0


def _quantile_or_double(window: Window, q: float, since: int) -> int:
    """The ``q`` quantile of the lengths past ``since``; past every one, twice ``since``."""
    guess = window.quantile_past(q, since)
    return 2 * since if guess is None else guess


def _survival(window: Window, max_tokens: int, since: int, points: Sequence[int]) -> list[float]:
    """For an answer longer than ``since``, P(longer than each of ``points``) from one window's lengths; past all
    of them it ends at twice ``since`` (at least a token more); at ``max_tokens`` it has ended."""
    alive = window.longer_than(since)
    if alive == 0:
        end = min(max_tokens, max(2 * since, since + 1))
        return [1.0 if x < end else 0.0 for x in points]
    return [window.longer_than(x) / alive if x < max_tokens else 0.0 for x in points]
