"""Rolling restarts of several managed engines: one engine at a time, and only while another serves.

Restarting vLLM now and then is the usual cure for slow memory creep (allocator fragmentation). With several
engines the gateway restarts them in turn (``--restart-every``, or ``POST /guard/restart``): each one is drained
(its supervisor holds it, so new requests go to the others) and restarted, and the next one waits until it is
ready again, so the pool never drops to zero capacity. A ready engine is restarted only while another engine is
ready; if none becomes ready within the wait (the start-up timeout), it is skipped and the status says so.
A restart the supervisor makes by itself (a crash, a hang) is its own: the rolling turn waits for it to end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from gateway.managed.lifecycle import EngineLifecycle
from gateway.managed.tasks import OwnedTasks
from gateway.periodic import Periodic

log = logging.getLogger(__name__)

# How often the turn looks whether another engine is ready (a start-up takes tens of seconds).
READY_POLL = 0.5


class Restartable(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def state(self) -> EngineLifecycle: ...
    async def restart(self, reason: str, *, detail: str | None = None) -> None: ...


class RollingRestarts:
    """Owns the rolling restarts: the periodic schedule and the ones asked for; ``close()`` ends them."""

    def __init__(
        self,
        engines: Sequence[Restartable],
        *,
        every: float | None,
        ready_timeout: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._engines = list(engines)
        self._every = every
        self._ready_timeout = ready_timeout
        self._clock = clock
        self._sleep = sleep
        self._tasks = OwnedTasks()
        self._schedule = None if every is None else Periodic(
            self._scheduled_turn, every, name="rolling-restarts", immediately=False,
            failed="a scheduled rolling restart failed", logger=log, sleep=sleep,
        )
        self._turn: asyncio.Task[None] | None = None
        self._turn_names: list[str] = []
        self._next_at: float | None = None
        self._current: str | None = None
        self.rounds = 0
        self.last: dict[str, Any] | None = None  # the last turn: reason, engines restarted and skipped, seconds

    def names(self) -> list[str]:
        return [e.name for e in self._engines]

    def start(self) -> None:
        """Begin the schedule (``--restart-every``); nothing without one."""
        if self._schedule is not None and not self._schedule.running:
            self._next_at = self._clock() + self._schedule.interval()
            self._schedule.start()

    def request(self, names: Sequence[str] | None = None, reason: str = "manual") -> tuple[list[str], bool]:
        """Restart the named engines (all when None) one at a time, in the background. Returns the engines of
        the turn under way and whether this call started it (False: one was running, and it goes on)."""
        if self._turn is not None and not self._turn.done():
            return self._turn_names, False
        wanted = [e for e in self._engines if names is None or e.name in names]
        self._turn_names = [e.name for e in wanted]
        self._turn = self._tasks.spawn(self._roll(wanted, reason))
        return self._turn_names, True

    async def wait(self) -> None:
        """Until the turn under way (if any) has ended."""
        if self._turn is not None:
            await asyncio.shield(self._turn)

    async def close(self) -> None:
        if self._schedule is not None:
            await self._schedule.stop()
        await self._tasks.close()

    def status(self) -> dict[str, Any]:
        running = self._turn is not None and not self._turn.done()
        next_in = None if self._next_at is None else max(0.0, round(self._next_at - self._clock(), 1))
        return {
            "every_seconds": self._every, "next_in_seconds": next_in, "in_progress": running,
            "restarting": self._current if running else None, "rounds": self.rounds, "last": self.last,
        }

    # -- the turns ------------------------------------------------------------------------------
    async def _scheduled_turn(self) -> None:
        self._next_at = None
        if self._turn is not None and not self._turn.done():
            await asyncio.shield(self._turn)  # an operator's turn is this period's
        else:
            self.request(None, "scheduled")
            await self.wait()
        if self._every is not None:
            self._next_at = self._clock() + self._every  # the next period begins as this turn ends

    async def _roll(self, engines: list[Restartable], reason: str) -> None:
        started = self._clock()
        restarted: list[str] = []
        skipped: dict[str, str] = {}
        try:
            for engine in engines:
                why = await self._wait_for_another(engine)
                if why is not None:
                    skipped[engine.name] = why
                    log.warning("rolling restart: engine %s skipped: %s", engine.name, why)
                    continue
                self._current = engine.name
                log.info("rolling restart (%s): restarting engine %s", reason, engine.name)
                await engine.restart(reason)
                restarted.append(engine.name)
        finally:
            self._current = None
            self.rounds += 1
            self.last = {
                "reason": reason, "restarted": restarted, "skipped": skipped,
                "seconds": round(self._clock() - started, 1),
            }
        log.info("rolling restart (%s) done in %.1f s: %s restarted", reason, self._clock() - started,
                 ", ".join(restarted) or "none")

    async def _wait_for_another(self, engine: Restartable) -> str | None:
        """None once ``engine`` may restart without leaving the pool empty, else why it may not."""
        others = [e for e in self._engines if e is not engine]
        if not others or engine.state is not EngineLifecycle.READY:
            return None  # nothing else to keep serving, or it serves nothing now anyway
        deadline = self._clock() + self._ready_timeout
        while not any(e.state is EngineLifecycle.READY for e in others):
            if self._clock() >= deadline:
                return f"no other engine was ready within {self._ready_timeout:g} s"
            await self._sleep(READY_POLL)
        return None
