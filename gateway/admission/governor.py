"""The objective's governor: how many requests the engine may run at once for first tokens to come in time.

KV blocks alone let a compute-bound engine take as many requests as its cache holds; each step then takes
longer, prefills of new requests wait behind them, and requests admitted at once still miss ``--ttft-objective``
(the CPU engine at twice its capacity: 59% of the admitted within a 5-s objective). With an objective set, the
governor caps the requests in flight, additive increase and multiplicative decrease on the engine's own time to a
first token (from admission to the first streamed token, the samples ``deadlines.FirstTokens`` learns from):

- a sample over ``TARGET_SHARE`` of the objective (the rest is the queue's to spend) cuts the cap to ``CUT`` of
  the requests in flight, at most once per ``CUT_SPACING`` seconds (one slow step delays many first tokens at
  once: they are one signal, not many);
- a sample within it, while the cap binds, raises the cap by ``1 / cap``: about one request per round of the cap;
- the cap never goes below ``FLOOR``.

Requests the capped engine cannot start in time wait out what their deadline allows and are refused (503
``deadline``), as the deadlines say. Without an objective there is no cap.
"""

from __future__ import annotations

from collections.abc import Callable

TARGET_SHARE = 0.5
CUT = 0.8
CUT_SPACING = 1.0
FLOOR = 4


class Governor:
    def __init__(self, objective: float | None, clock: Callable[[], float]) -> None:
        self._objective = objective
        self._clock = clock
        self.limit: float | None = None
        self._last_cut: float | None = None

    def sample(self, seconds: float, in_flight: int) -> None:
        """A request got its first token ``seconds`` after admission, with ``in_flight`` requests running."""
        if self._objective is None:
            return
        if seconds > self._objective * TARGET_SHARE:
            now = self._clock()
            if self._last_cut is None or now - self._last_cut >= CUT_SPACING:
                self._last_cut = now
                base = in_flight if self.limit is None else min(in_flight, self.limit)
                self.limit = max(float(FLOOR), CUT * base)
        elif self.limit is not None and in_flight >= self.limit - 1:
            self.limit += 1.0 / self.limit

    def allows(self, in_flight: int) -> bool:
        """Whether one more request may go to the engine now."""
        return self.limit is None or in_flight < self.limit

    def status(self) -> float | None:
        return None if self.limit is None else round(self.limit, 2)
