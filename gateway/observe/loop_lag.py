"""How late the event loop runs what is due: the lag every client waits for, whatever it asked.

One owned task sleeps ``interval`` seconds at a time and records how much later than asked it woke up. A
callback that holds the loop (CPU work on it, a blocking call) delays that wake-up by as long as it holds it:
any stall longer than ``interval`` is seen whole, shorter ones when they overlap a sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

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
        self._sleep = sleep
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-lag")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            asked = self._clock() + self._interval
            await self._sleep(self._interval)
            self._record(max(0.0, self._clock() - asked))
