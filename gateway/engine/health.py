"""Whether the engine says it is healthy: vLLM's own ``/health``, asked every ``INTERVAL`` in proxy mode.

vLLM answers ``/health`` with 503 once its engine core is dead (``EngineDeadError``; its API server exits some
seconds later, on a watchdog of its own), and requests sent to it meanwhile fail. Such an engine takes no new
request from the gateway (``Engine.refusal``): ``/health`` says ``down`` and admission places nothing on it.
Only a 5xx answer counts: a transport failure or another status (an engine with no ``/health``) says nothing
here, since the scrapes of ``/metrics`` tell whether the engine answers at all (``live.EngineView.answering``).
A frozen engine core still answers 200: that is the hang detector's (``gateway/engine/progress.py``).

A managed engine has its supervisor's probes and watchdog instead; this runs in proxy mode only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

HEALTH_PATH = "/health"
INTERVAL = 1.0

Fetch = Callable[[str], Awaitable[tuple[int, bytes]]]


class EngineHealth:
    """The engine's latest ``/health`` verdict; ``unhealthy`` while its latest answer was a 5xx."""

    def __init__(
        self, fetch: Fetch | None = None, *, interval: float = INTERVAL,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._fetch = fetch
        self._interval = interval
        self._sleep = sleep
        self.status: int | None = None  # the latest answer's HTTP status; None before one came
        self._task: asyncio.Task[None] | None = None

    @property
    def unhealthy(self) -> bool:
        return self.status is not None and self.status >= 500

    async def check(self) -> None:
        """Ask once; a failure to ask keeps the verdict as it was."""
        if self._fetch is None:
            return
        try:
            status, _ = await self._fetch(HEALTH_PATH)
        except Exception as exc:
            log.debug("engine %s failed: %r", HEALTH_PATH, exc)
            return
        if (status >= 500) != self.unhealthy:
            log.warning("the engine's %s answered HTTP %d: %s", HEALTH_PATH, status,
                        "it takes no new request until it answers 200" if status >= 500 else "it takes requests again")
        self.status = status

    async def start(self) -> None:
        if self._fetch is not None and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._run(), name="engine-health")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None or task.done():
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise

    async def _run(self) -> None:
        while True:
            try:
                await self.check()
            except Exception:
                log.exception("the engine health check crashed")  # the timer itself must never die
            await self._sleep(self._interval)
