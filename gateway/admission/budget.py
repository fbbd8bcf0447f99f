"""The preemption budget: how far past the worst case the default policy admits, held to what the engine can take.

The adaptive policy books each request at a quantile of the lengths answers really run to (``lengths``), not at
its ``max_tokens``; the closer that quantile is to 1, the closer the booking is to the worst case. A capped
number of preemptions costs the engine less than holding half its batch back (vLLM's own measurements: a
watermark that lets a few happen beats both none and unlimited), so the controller lets the engine preempt, up
to ``--preemption-budget`` preemptions per 100 completed requests, and holds admission back only past it:

- the *level* (``value``, shown as ``optimism``) is in [0, 1] (past 1: the reach, last below); the booking
  quantile is ``1 - min(value, 1) x (1 - BEST_QUANTILE)``, and at 0 every request is booked at its worst case
  (``max_tokens``);
- on a fresh snapshot with new preemptions, when those of the last ``WINDOW_SECONDS`` exceed the budget over the
  requests completed in that time (at least ``MIN_COMPLETIONS`` of them: a handful of completions is no base for
  a rate), the level is halved (to 0 below ``LEVEL_FLOOR``), at most once per ``BACKOFF_SPACING`` (one burst of
  preemptions spans several scrapes): from full to the worst case in about 5 s of preemptions past the budget;
- on a snapshot without new preemptions, while nothing waits inside the engine (``vllm:num_requests_waiting``:
  a request the engine queues is one admission sent too early), it regains ``RECOVERY_PER_SECOND`` per second;
- preemptions while traffic that bypasses the gateway runs are not held against admission (backing off would
  not stop them), as before;
- past full, the level goes on up to ``1 + MAX_REACH`` (``reach``: the projected peak may then pass the budget
  by that share) at ``REACH_PER_SECOND``, but only on snapshots where the engine has room the projection does
  not see: requests wait in the gateway's queue while the engine's own KV usage is under ``ROOM_BELOW`` of the
  budget, nothing waits in the engine, nothing new was preempted and the preemptions of the window are within
  the budget (one burst past it takes the reach away until it has aged out). The projection is a model (streams the
  gateway relays late, requests that end in the engine before their stream does, a peak that may never come):
  sampled every 0.5 s at twice capacity, it stood at the budget while vLLM used 53-97% of its cache and the
  gateway queued 100-144 requests. Without the queue's condition the reach grew while the load ramped up (the
  engine's room was then the load's, not the model's), overshot to 1.26x the budget and brought a burst of
  preemptions. Preemptions past the budget take the reach away at once; later ones (at most once a second)
  halve the level as before. So the engine's own usage and preemptions set how far past the model admission
  goes. Under a TTFT objective (the operator's, or the one derived under a sustained overload) the reach also
  needs time in the engine: room in the cache is not time in a compute-bound engine, whose fuller batch runs each
  step slower. It grows only while the engine's own time to a first token leaves room within the objective
  (``deadlines.Deadlines.compute_room``), and is taken away once it does not.

``--preemption-budget`` is 3 by default: on the realistic benchmark's chat workload at twice capacity
(``python -m bench run realistic``: 48 streams/s) the bare engine preempted 15-19 times per 100 requests; the target
is a quarter of that, and in paired runs a budget of 3 held the engine to 15-18 preemptions per 950-request run (a
tenth of vLLM alone's) at 0.94x its tokens/s against 0.89x with a budget of 1.
"""

from __future__ import annotations

from collections import deque

from gateway.engine.live import counter_increase

BEST_QUANTILE = 0.7  # the booking quantile at full level: the lengths' mean on a lognormal of sigma 0.8 is ~0.66
LEVEL_FLOOR = 1.0 / 16
BACKOFF = 0.5
BACKOFF_SPACING = 1.0
RECOVERY_PER_SECOND = 0.05  # from the worst case back to full in 20 s without preemptions
MAX_REACH = 0.5
REACH_PER_SECOND = 0.05  # from none to full reach in 10 s while the engine has room
ROOM_BELOW = 0.9  # of the budget: an engine this full has no room the projection misses
MAX_RECOVERY_STEP_SECONDS = 2.0  # a long gap between snapshots (outage) does not count as clean time
WINDOW_SECONDS = 30.0
MIN_COMPLETIONS = 20


class PreemptionBudget:
    """The level of admission past the worst case, moved by the engine's preemptions against the budget."""

    def __init__(self, budget: float = 1.0) -> None:
        self.budget = budget
        self.value = 1.0
        self._last_preemptions: float | None = None
        self._preempted: deque[tuple[float, float]] = deque()  # (when, how many), within the window
        self._completed: deque[float] = deque()
        self._last_backoff: float | None = None

    @property
    def quantile(self) -> float:
        """The quantile of the answers' lengths requests are booked at (1: the worst case)."""
        return 1.0 if self.value <= 0.0 else 1.0 - min(1.0, self.value) * (1.0 - BEST_QUANTILE)

    @property
    def reach(self) -> float:
        """How far past the budget the projected peak may go, as a share of the budget."""
        return max(0.0, self.value - 1.0)

    def completed(self, at: float) -> None:
        """A request admitted by the gateway ran to its end at ``at``."""
        self._completed.append(at)
        self._prune(at)

    def rate(self, now: float) -> float:
        """Preemptions per 100 completed requests over the window (completions counted at least as
        ``MIN_COMPLETIONS``)."""
        self._prune(now)
        return 100.0 * sum(n for _, n in self._preempted) / max(len(self._completed), MIN_COMPLETIONS)

    def observe(
        self, preemptions_total: float | None, clean_seconds: float | None, *, at: float = 0.0,
        blame: bool = True, engine_waiting: bool = False, engine_room: bool = False, compute_room: bool = True,
    ) -> float:
        """Account one fresh snapshot taken ``at``; ``clean_seconds`` is the time since the previous good one
        (None if there was none); ``engine_room``: the engine has room the projection does not see (requests wait
        in the gateway while the engine's own usage is under ``ROOM_BELOW`` of the budget: ``Projector.observe``);
        ``compute_room``: its steps leave time for more within the TTFT objective (``Deadlines.compute_room``):
        without it the reach is taken away. Returns the preemptions new since the last snapshot."""
        if not compute_room:
            self.value = min(self.value, 1.0)
        increase = counter_increase(self._last_preemptions, preemptions_total)
        if preemptions_total is not None:
            self._last_preemptions = preemptions_total
        if increase > 0 and not blame:
            return increase
        if increase > 0:
            self._preempted.append((at, increase))
            spaced = self._last_backoff is None or at - self._last_backoff >= BACKOFF_SPACING
            if spaced and self.rate(at) > self.budget:
                self._last_backoff = at
                self.value = 1.0 if self.value > 1.0 else self.value * BACKOFF
                if self.value < LEVEL_FLOOR:
                    self.value = 0.0
        elif clean_seconds is not None and not engine_waiting:
            step = min(MAX_RECOVERY_STEP_SECONDS, max(0.0, clean_seconds))
            if self.value < 1.0:
                self.value = min(1.0, self.value + RECOVERY_PER_SECOND * step)
            elif engine_room and compute_room and self.rate(at) <= self.budget:
                self.value = min(1.0 + MAX_REACH, self.value + REACH_PER_SECOND * step)
        return increase

    def status(self, now: float) -> dict[str, float]:
        return {
            "budget_per_100": self.budget,
            "preemptions_per_100": round(self.rate(now), 3),
            "level": round(self.value, 4),
            "reach": round(self.reach, 4),
            "quantile": round(self.quantile, 4),
        }

    def _prune(self, now: float) -> None:
        since = now - WINDOW_SECONDS
        while self._preempted and self._preempted[0][0] < since:
            self._preempted.popleft()
        while self._completed and self._completed[0] < since:
            self._completed.popleft()
