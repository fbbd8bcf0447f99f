"""Background loops that do one thing every so often: one owned task per loop, started and stopped one way.

A ``Periodic`` runs its ``run`` (a plain or an async function; what it returns is ignored) every ``every``
seconds, first at once or one interval after ``start`` (``immediately``). The interval is counted from the end of
one run to the start of the next, as a sleep: a slow run delays the ones after it, and runs never overlap. ``every``
may be a function, read before each sleep, for a loop that paces itself; ``jitter`` spreads the sleeps (a fraction
of the interval either side) so that loops of many processes drift apart.

A run that raises is logged with its traceback once per streak of failures, the next ones of the streak at debug
level, and the end of the streak once, with its length: a loop that fails every tick must not fill the log, nor
stop, since it is the loop that keeps the gateway's view of the world fresh. ``stop_on_error`` ends the loop at
its first failure instead, for a loop whose later runs would be wrong after a failed one.

``stop`` cancels the task and waits until it has ended; it is idempotent, and a stop cancelled from outside is
cancelled (the cancellation goes on, not swallowed). The sleep and the random source are injectable: tests wake the
loop by hand and never sleep.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)

Every = float | Callable[[], float]


class Periodic:
    """``run`` every ``every`` seconds in a task of its own, between ``start`` and ``stop``.

    ``failed`` is the message logged (with the traceback) when a run raises; ``logger`` is the owner's, so that
    the record names the module the loop belongs to.
    """

    def __init__(
        self,
        run: Callable[[], object],
        every: Every,
        *,
        name: str,
        failed: str,
        immediately: bool = True,
        jitter: float = 0.0,
        stop_on_error: bool = False,
        logger: logging.Logger = log,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        uniform: Callable[[float, float], float] = random.uniform,
    ) -> None:
        if not 0.0 <= jitter < 1.0:
            raise ValueError(f"jitter is a fraction of the interval, from 0 up to 1; got {jitter!r}")
        self._run = run
        self._every = every
        self.name = name
        self._failed = failed
        self._immediately = immediately
        self._jitter = jitter
        self._stop_on_error = stop_on_error
        self._log = logger
        self._sleep = sleep
        self._uniform = uniform
        self._task: asyncio.Task[None] | None = None
        self.failures = 0  # runs failed in a row, up to now

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start the loop; a loop already running goes on as it is."""
        if not self.running:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=self.name)

    async def stop(self) -> None:
        """Cancel the loop and wait until it has ended (at once when it is not running)."""
        task, self._task = self._task, None
        if task is not asyncio.current_task():  # a run stopping its own loop: the loop ends as the run returns
            await cancel_and_wait(task)

    def interval(self) -> float:
        """The next sleep: ``every``, spread by ``jitter``."""
        every = self._every() if callable(self._every) else self._every
        if self._jitter:
            every *= 1.0 + self._uniform(-self._jitter, self._jitter)
        return max(0.0, every)

    async def _loop(self) -> None:
        if not self._immediately:
            await self._sleep(self.interval())
        while True:
            ok = await self._once()
            if (not ok and self._stop_on_error) or self._task is not asyncio.current_task():
                return
            await self._sleep(self.interval())

    async def _once(self) -> bool:
        try:
            result = self._run()
            if inspect.isawaitable(result):
                await result
        except Exception:
            self.failures += 1
            if self._stop_on_error:
                self._log.exception("%s; the loop stops", self._failed)
            elif self.failures == 1:
                self._log.exception("%s (logged once until it works again)", self._failed)
            else:
                self._log.debug("%s (%d times in a row)", self._failed, self.failures, exc_info=True)
            return False
        if self.failures:
            self._log.warning("%s %d times in a row; it works again", self._failed, self.failures)
            self.failures = 0
        return True


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and wait until it has ended. The caller's own cancellation, should it come meanwhile, goes
    on (it is not taken for the task's)."""
    if task is None or task.done():
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
