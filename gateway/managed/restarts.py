"""The restart policy: how many restarts a sliding window allows, and the back-off between them."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

BACKOFF_MAX = 60.0


class RestartBudget:
    """Counts restarts within ``window`` seconds; gives up at ``max_restarts`` and backs off exponentially before."""

    def __init__(
        self, *, max_restarts: int, window: float, backoff_base: float, clock: Callable[[], float]
    ) -> None:
        self.max_restarts = max_restarts
        self.window = window
        self.backoff_base = backoff_base
        self.clock = clock
        self._history: deque[float] = deque()

    def exhausted(self) -> str | None:
        """Why no further restart is allowed now, or None while the window has room for one."""
        now = self.clock()
        while self._history and now - self._history[0] >= self.window:
            self._history.popleft()
        if len(self._history) < self.max_restarts:
            return None
        return f"{len(self._history)} restarts within {self.window:g} s (limit {self.max_restarts}); giving up"

    def delay(self) -> float:
        """Seconds to wait before the next restart: none for the first of a window, then doubling."""
        if not self._history:
            return 0.0
        return min(BACKOFF_MAX, self.backoff_base * 2.0 ** (len(self._history) - 1))

    def record(self) -> None:
        self._history.append(self.clock())

    def clear(self) -> None:
        """Forget past restarts: an operator asked for one after the supervisor gave up."""
        self._history.clear()
