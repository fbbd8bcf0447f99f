"""Deadlines: how long a request may wait in the gateway's queue, given when its client wants a first token.

A request's own deadline is the earliest of what its client says (``x-guard-deadline-ms``, or the OpenAI SDKs'
``x-stainless-read-timeout``: a client that gives up at 30 s gains nothing from a first token at 31 s) and the
operator's ``--ttft-objective``. Its first token comes after its wait in the queue *and* the engine's own time to
a first token once admitted (prefill queued ahead of it inside the engine, and the steps of the batch it joins),
so the queue may hold it for its deadline less that engine time, and never past ``--queue-timeout``.

The engine's time to first token is learned from the streams the gateway relays: from a request's admission to
its first streamed token (``FirstTokens``; a non-streamed answer reports its tokens only at the end, and is not a
sample), over the last ``WINDOW_SECONDS``, at its ``QUANTILE`` (most admitted requests must make their deadline,
not the average one). It is used only while requests are in flight: an idle engine's figure is its prefill alone,
and a figure learned under a load that has gone would otherwise refuse requests it can serve.

A request whose deadline leaves it no time to wait is refused as it arrives (503 ``deadline``), and one forecast
to wait past it is refused at once by the forecast (``forecast``), with a computed ``Retry-After``; one that
reaches its deadline in the queue all the same gets the same 503: a busy engine missed it, and later, less busy,
it may not. A deadline below ``MIN_DEADLINE_SECONDS`` is another matter: no engine meets it, busy or idle, so
it is the client's mistake, refused as the request is read (400 naming the header and this floor), not a 503
that the OpenAI SDKs would retry in vain.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

WINDOW_SECONDS = 10.0
MIN_SAMPLES = 4
QUANTILE = 0.9
# The shortest deadline a client may give (seconds to a first token). A fixed floor rather than the engine's
# learned time to a first token: that time depends on the prompt and on the load, and a 400 must hold for the
# request whatever the engine's state (a client error is not retried), while no engine ever answers within a
# millisecond: the round trip to it and one step of its model take longer, and vLLM's own API server adds
# milliseconds before either. Deadlines above it that a busy engine misses stay 503 with Retry-After.
MIN_DEADLINE_SECONDS = 0.001


class Deadlined(Protocol):
    @property
    def deadline(self) -> float | None: ...


@dataclass(frozen=True)
class WaitLimit:
    """How long a request may wait in the queue, and whether its own deadline (rather than ``--queue-timeout``)
    sets that."""

    seconds: float
    own: bool
    engine_seconds: float  # the engine's time to a first token it allows for


class FirstTokens:
    """The engine's time from admission to a first token, over the requests admitted lately."""

    def __init__(self, clock: Callable[[], float], window: float = WINDOW_SECONDS) -> None:
        self._clock = clock
        self._window = window
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, seconds: float) -> None:
        now = self._clock()
        self._samples.append((now, max(0.0, seconds)))
        self._prune(now)

    def estimate(self) -> float | None:
        """The ``QUANTILE`` of the window's samples; None with fewer than ``MIN_SAMPLES``."""
        self._prune(self._clock())
        if len(self._samples) < MIN_SAMPLES:
            return None
        ordered = sorted(s for _, s in self._samples)
        return ordered[min(len(ordered) - 1, math.ceil(QUANTILE * len(ordered)) - 1)]

    def _prune(self, now: float) -> None:
        while self._samples and self._samples[0][0] < now - self._window:
            self._samples.popleft()


class Deadlines:
    def __init__(self, queue_timeout: float, objective: float | None, clock: Callable[[], float]) -> None:
        self.queue_timeout = queue_timeout
        self.objective = objective
        self.first_tokens = FirstTokens(clock)

    def limit(self, r: Deadlined, in_flight: int) -> WaitLimit:
        own = [d for d in (r.deadline, self.objective) if d is not None]
        if not own:
            return WaitLimit(self.queue_timeout, False, 0.0)
        engine = (self.first_tokens.estimate() or 0.0) if in_flight else 0.0
        allowed = min(own) - engine
        if allowed < self.queue_timeout:
            return WaitLimit(allowed, True, engine)
        return WaitLimit(self.queue_timeout, False, engine)

    def status(self) -> dict[str, float | None]:
        estimate = self.first_tokens.estimate()
        return {
            "ttft_objective_s": self.objective,
            "engine_first_token_s": None if estimate is None else round(estimate, 3),
        }
