"""How late the event loop runs what is due: the lag every client waits for, whatever it asked.

One periodic loop sleeps ``interval`` seconds at a time and records how much later than asked it woke up. A
callback that holds the loop (CPU work on it, a blocking call) delays that wake-up by as long as it holds it:
any stall longer than ``interval`` is seen whole, shorter ones when they overlap a sleep.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from gateway.periodic import Periodic

log = logging.getLogger(__name__)

# Ten wake-ups a second cost nothing measurable, and see every stall longer than 0.1 s.
DEFAULT_INTERVAL = 0.1


class LoopLag:
    """``record`` receives each lag in seconds (0 or more). ``clock`` and ``sleep`` are injectable for tests."""

    def __init__(
        self,
        record: Callable[[float], None],
        *,
        interval: float = DEFAULT_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        self._record = record
        self._interval = interval
        self._clock = clock
        self._asked: float | None = None  # when the sleep under way was asked to end
        self._timer = Periodic(
            self._wake, interval, name="loop-lag", failed="recording the event loop's lag failed", logger=log,
            sleep=sleep,
        )

    async def start(self) -> None:
        if not self._timer.running:
            self._asked = None
            self._timer.start()

    async def stop(self) -> None:
        await self._timer.stop()

    def _wake(self) -> None:
        # Run at once on start, then after each sleep: the loop sleeps right after it returns, so ``asked`` is when
        # that sleep should end.
        now = self._clock()
        if self._asked is not None:
            self._record(max(0.0, now - self._asked))
        self._asked = now + self._interval
