"""How long answers run: the distribution of real completion lengths, from which the default policy books a
request's expected output rather than its ``max_tokens``.

Lengths are the output tokens per sequence of requests that ran to their end (``Reservation.completed_output``:
the engine's own usage figures where it gives them), kept per *family* (served model and route), per
``max_tokens`` bucket (powers of two: a client that asks for 64 tokens stops differently from one that asks for
4,096, and answers cut at ``max_tokens`` pile up at the bucket's top), and per tenant once that tenant has
``TENANT_MIN_SAMPLES`` of its own in the bucket (until then its family's figures stand for it).

A request is booked at a quantile ``q`` (the preemption controller's to set, ``budget``) of the lengths *longer
than what it has already generated*: a request still running after ``g`` tokens is one of the long ones, and its
booking grows with it as it goes. Past every length seen it is booked at twice what it has generated (at least a
token more), never past ``max_tokens``. ``q = 1`` is the worst case: ``max_tokens``.

With fewer than ``MIN_SAMPLES`` lengths in its bucket a request is booked at a quarter of its ``max_tokens``
(``PRIOR_SHARE``; at least ``PRIOR_MIN`` tokens): chat clients ask for far more than they use (the benchmark's
answers average 200 tokens of 1,024 asked), booking the worst case until samples come held half the batch the
engine would run, and a prior that proves short costs preemptions that the controller answers within seconds.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence

WINDOW = 256  # lengths remembered per bucket: the quantiles follow a change of traffic within minutes
MIN_SAMPLES = 8  # fewer than this in a bucket: the prior
TENANT_MIN_SAMPLES = 32  # a tenant's own figures once it has this many in the bucket
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
        """How many lengths a request of this family, tenant and ``max_tokens`` is booked from (0: the prior)."""
        window = self._window(family, tenant, max_tokens)
        return 0 if window is None else len(window)

    def expected(self, family: str, tenant: str, max_tokens: int, generated: int, q: float) -> int:
        """Output tokens per sequence to book for a request that has generated ``generated`` per sequence."""
        if q >= 1.0:
            return max_tokens
        window = self._window(family, tenant, max_tokens)
        if window is None:
            guess: int | None = prior(max_tokens) if generated < prior(max_tokens) else None
        else:
            guess = window.quantile_past(q, generated)
        if guess is None:  # longer than anything seen: grows with what it generates
            guess = 2 * generated
        return min(max_tokens, max(guess, generated + 1))

    def survival(
        self, family: str, tenant: str, max_tokens: int, generated: int, offsets: Sequence[int]
    ) -> list[float]:
        """For a request still running after ``generated`` tokens per sequence, the chance that it is still
        running ``s`` tokens later, for each ``s`` in ``offsets``: the share of the lengths past ``generated``
        that are past ``generated + s``. With no lengths past ``generated`` (or none learned yet) it is taken to
        end where ``expected`` books it: twice what it generated, or the prior."""
        window = self._window(family, tenant, max_tokens)
        alive = 0 if window is None else window.longer_than(generated)
        if window is None or alive == 0:
            end = self.expected(family, tenant, max_tokens, generated, 0.5)
            return [1.0 if generated + s < end else 0.0 for s in offsets]
        out = []
        for s in offsets:
            if generated + s >= max_tokens:
                break
            out.append(window.longer_than(generated + s) / alive)
        return out + [0.0] * (len(offsets) - len(out))

    def _window(self, family: str, tenant: str, max_tokens: int) -> Window | None:
        b = bucket(max_tokens)
        own = self._windows.get((family, tenant, b))
        if own is not None and len(own) >= TENANT_MIN_SAMPLES:
            return own
        shared = self._windows.get((family, None, b))
        return shared if shared is not None and len(shared) >= MIN_SAMPLES else None

    def status(self) -> dict[str, int]:
        """Lengths held per family and bucket (``family/max_tokens<=2^b``), for ``/guard/status``."""
        return {f"{f}/<={2 ** b}": len(w) for (f, t, b), w in sorted(self._windows.items(), key=str) if t is None}
