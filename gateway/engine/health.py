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

from gateway.periodic import Periodic

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
        self.status: int | None = None  # the latest answer's HTTP status; None before one came
        self.on_change: Callable[[], None] | None = None  # with --workers: the authority tells its workers at once
        self._timer = Periodic(
            lambda: self.check(), interval, name="engine-health", failed="the engine health check crashed",
            logger=log, sleep=sleep,
        )

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
        changed = (status >= 500) != self.unhealthy
        if changed:
            log.warning("the engine's %s answered HTTP %d: %s", HEALTH_PATH, status,
                        "it takes no new request until it answers 200" if status >= 500 else "it takes requests again")
        self.status = status
        if changed and self.on_change is not None:
            self.on_change()

    async def start(self) -> None:
        if self._fetch is not None:
            self._timer.start()

    async def stop(self) -> None:
        await self._timer.stop()
