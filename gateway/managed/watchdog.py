"""The watchdog's decisions: when a serving engine must be restarted, from observations stamped by the caller.

Free of I/O so that every rule can be tested with made-up times; the supervisor probes the engine and feeds
the answers in.

A hang is no progress while work runs. Progress is generated tokens moving, and also any answer that completed
through the gateway (an engine that answers at once may never be seen running). A busy API server (vLLM's one
event loop held by a large /tokenize or a burst) answers ``/health`` late or not at all while its engine core
still generates: a silent ``/health`` is a hang only when nothing moved either for the whole bound.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from gateway.engine.vllm_api import parse_metrics

STORM_WINDOW = 60.0

# (running requests, generated tokens, preemptions), each None where the engine does not report it.
Progress = tuple[float | None, float | None, float | None]

def parse_progress(text: str) -> Progress:
    """(running requests, generated tokens, preemptions) summed over engines from vLLM's /metrics: the
    engine package's one parser of that page."""
    return parse_metrics(text).progress


@dataclass(frozen=True)
class Trouble:
    """Why the engine must be restarted, and the observation that says so."""

    reason: str  # exit | oom | hang | memory_growth | preemption_storm
    detail: str


class Watchdog:
    """Decides when a serving engine must be restarted, from observations stamped by the caller."""

    def __init__(
        self, now: float, *, hang_timeout: float, growth_mib: float, storm: int, storm_window: float = STORM_WINDOW
    ) -> None:
        self.hang_timeout = hang_timeout
        self.growth_mib = growth_mib
        self.storm = storm
        self.storm_window = storm_window
        self._last_alive = now
        self._last_progress = now
        self._tokens: float | None = None
        self._answers: int | None = None
        self._was_running = False
        self._preemptions: deque[tuple[float, float]] = deque()
        self.baseline_mib: float | None = None

    def observe_health(self, now: float, ok: bool) -> Trouble | None:
        if ok:
            self._last_alive = now
            return None
        # An engine still moving has a busy API server, not a dead one.
        silent = now - max(self._last_alive, self._last_progress)
        if silent >= self.hang_timeout:
            return Trouble(
                "hang", f"/health failed or did not answer for {silent:.1f} s (limit {self.hang_timeout:g} s)"
            )
        return None

    def observe_answers(self, now: float, answers: int | None) -> None:
        """The count of answers completed through the gateway so far: one more since the last call is progress."""
        if answers is None:
            return
        if self._answers is not None and answers != self._answers:
            self._last_progress = now
        self._answers = answers

    def observe_engine(
        self, now: float, running: float | None, tokens: float | None, preemptions: float | None
    ) -> Trouble | None:
        if running is not None and tokens is not None:
            # /health stays 200 in a hung engine: only generated tokens prove progress.
            # A stall counts from the first observation with work, since it may have just arrived.
            stalled = running > 0 and self._was_running and tokens == self._tokens
            self._was_running = running > 0
            if not stalled:
                self._last_progress = now
                self._tokens = tokens
            elif now - self._last_progress >= self.hang_timeout:
                return Trouble(
                    "hang",
                    f"{running:g} requests running but vllm:generation_tokens_total stayed at {tokens:g} for "
                    f"{now - self._last_progress:.1f} s (limit {self.hang_timeout:g} s)",
                )
        if preemptions is not None and self.storm > 0:
            q = self._preemptions
            if q and preemptions < q[-1][1]:
                q.clear()  # a new engine restarted its counter
            q.append((now, preemptions))
            while len(q) > 1 and q[1][0] <= now - self.storm_window:
                q.popleft()
            burst = preemptions - q[0][1]
            if burst >= self.storm:
                return Trouble(
                    "preemption_storm",
                    f"{burst:g} preemptions within {self.storm_window:g} s (limit {self.storm})",
                )
        return None

    def observe_memory(self, mib: float | None) -> Trouble | None:
        if mib is None or self.growth_mib <= 0:
            return None
        if self.baseline_mib is None:
            self.baseline_mib = mib
            return None
        growth = mib - self.baseline_mib
        if growth >= self.growth_mib:
            return Trouble(
                "memory_growth",
                f"GPU memory grew {growth:.0f} MiB past its post-start {self.baseline_mib:.0f} MiB "
                f"(limit {self.growth_mib:g} MiB)",
            )
        return None
