"""Pace: how many requests may run in the engine at once while a TTFT objective holds, from the first tokens the
engine actually gave.

A request's time to a first token is its wait in the gateway's queue and then the engine's own time (its prefill
queued behind others inside the engine, and the steps of the batch it joins). The queue's part is bounded where the
request is judged (``deadlines``: an arrival forecast to wait past its objective less the engine's time is refused,
and a queued one is refused as soon as its wait so far and the engine's time now pass the objective). The engine's
part is not: KV blocks let a compute-bound engine take as many requests as its cache holds, every step then runs
slower, and the engine's own time to a first token grows under a queue that can then wait less and less. Forecasts
of that time drift with the load they admit (on a shared host, a slower card, longer prompts): so the cap on the
requests in flight is set by feedback on what happened to the requests admitted lately, not by a model.

Every ``STEP_SECONDS`` while an objective applies (the operator's ``--ttft-objective``, or, while an overload is
sustained under ``auto``, the derived one with ``--sustained-feedback on`` and twice it without:
``Deadlines.pace_objective``), over the requests admitted in the last ``WINDOW_SECONDS`` (and since the cap last
fell) whose first token came (the misses counted among those an objective judged as they arrived):

- **tighten** when the engine's own time (from the request's write to it to its first token) at the ``QUANTILE``
  passes ``ENGINE_SHARE`` of the objective, or more than ``MISSED_SHARE`` of them got their first token past the
  objective (wait included): the cap falls to ``DECREASE`` of the requests in flight (at least ``MIN_CAP``), and
  falls again only on requests admitted after that, once they show it was not enough;
- **loosen** while the cap binds (requests queued behind it) and the engine's time is under ``RELAX_SHARE`` of the
  objective, almost none missed it and nothing waits inside the engine: the cap grows by ``INCREASE`` of itself (at
  least one request) a step, additive as the decrease is multiplicative, so that the engine is kept as busy as the
  objective lets it be.

Without an objective (no flag and no sustained overload: a burst is queued whole and served as the engine alone
would serve it) there is no cap. Half the objective for the engine leaves the other half for the queue: a queue
that can wait nothing refuses every arrival that is not admitted at once, and the engine then runs short of work.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Final

WINDOW_SECONDS = 10.0
STEP_SECONDS = 1.0
MIN_SAMPLES = 8
QUANTILE = 0.9
ENGINE_SHARE = 0.5  # of the objective, that the engine's own time to a first token may take
RELAX_SHARE = 0.35  # of the objective, under which the engine's time lets the cap grow
MISSED_SHARE = 0.08  # of the admitted, past the objective: more tightens (the aim is 90% within it)
RELAX_MISSED_SHARE = 0.03  # of the admitted, past the objective: no more lets the cap grow
DECREASE = 0.8
INCREASE = 0.05
MIN_CAP = 2


class _Sample:
    """One first token. A plain class (compiled), not a frozen dataclass, whose ``__init__`` ran as Python, each
    field set through ``object.__setattr__``, for every first token (``WaitLimit``'s note)."""

    def __init__(self, admitted_at: float, engine: float, missed: bool | None) -> None:
        self.admitted_at: Final = admitted_at
        self.engine: Final = engine  # seconds from the request's write to its engine to the first token
        # Its first token came past its objective; None: no objective judged it as it arrived.
        self.missed: Final = missed


class Pace:
    """The cap on requests in flight that keeps first tokens within the objective (None: no cap)."""

    def __init__(self) -> None:
        self.cap: int | None = None
        self._samples: deque[_Sample] = deque()
        self._since = -math.inf  # samples of requests admitted before this are no evidence against the cap
        self._last_step = -math.inf
        self.engine_quantile: float | None = None  # as of the last step, for the status
        self.missed: float | None = None  # share of the admitted past the objective, as of the last step

    def first_token(self, now: float, waited: float, engine: float, objective: float | None) -> None:
        """A request admitted after waiting ``waited`` seconds got its first token ``engine`` seconds after;
        ``objective``: the one that judged it as it arrived. One queued before any did (a burst's, or the first of
        a sustained overload, seen as such only later) may have waited long: that is no evidence on the engine."""
        missed = None if objective is None else max(0.0, waited) + max(0.0, engine) > objective
        self._samples.append(_Sample(now - engine, max(0.0, engine), missed))

    def binds(self, in_flight: int) -> bool:
        return self.cap is not None and in_flight >= self.cap

    def step(self, now: float, objective: float | None, in_flight: int, queued: bool, engine_waiting: int) -> None:
        """Tighten or loosen the cap as of ``now``; ``objective``: the one that applies now (None: no cap);
        ``engine_waiting``: requests waiting inside the engine (its own queue)."""
        while self._samples and self._samples[0].admitted_at < now - WINDOW_SECONDS:
            self._samples.popleft()
        if objective is None or (not self._samples and not in_flight and not queued):
            # Without an objective there is no cap; with nothing run or asked for over a whole window, the cap
            # rests on evidence of a load that has gone (a low cap learned in one overload held the next one's
            # first seconds to it, and refused what the engine could serve).
            self.cap, self._since = None, -math.inf
            return
        if now - self._last_step < STEP_SECONDS:
            return
        self._last_step = now
        recent = [s for s in self._samples if s.admitted_at >= self._since]
        if len(recent) < MIN_SAMPLES:
            return
        engine = sorted(s.engine for s in recent)[math.ceil(QUANTILE * len(recent)) - 1]
        judged = [s.missed for s in recent if s.missed is not None]
        missed = sum(judged) / len(judged) if len(judged) >= MIN_SAMPLES else 0.0
        self.engine_quantile, self.missed = engine, missed
        if engine > ENGINE_SHARE * objective or missed > MISSED_SHARE:
            base = in_flight if self.cap is None else min(self.cap, in_flight)
            self.cap = max(MIN_CAP, math.floor(DECREASE * base))
            self._since = now  # the next fall needs evidence from requests admitted under this cap
        elif (self.cap is not None and queued and in_flight >= self.cap and engine_waiting <= 0
              and engine < RELAX_SHARE * objective and missed <= RELAX_MISSED_SHARE):
            self.cap += max(1, math.floor(INCREASE * self.cap))

    def status(self) -> dict[str, float | int | None]:
        return {
            "cap": self.cap,
            "engine_first_token_quantile_s": None if self.engine_quantile is None else round(self.engine_quantile, 3),
            "missed_share": None if self.missed is None else round(self.missed, 3),
        }
