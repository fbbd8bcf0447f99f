"""One engine's side of admission, for the supervisor that restarts it while other engines serve: pausing it
holds only that engine (its requests wait for another engine, or for it to come back), draining waits only for
its own requests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from gateway.admission.controller import Admission

# How often a drain looks whether the engine's last request has ended (a drain lasts seconds).
DRAIN_POLL = 0.1


class EngineControl:
    """What a managed engine's supervisor pauses and drains when the gateway runs several engines."""

    def __init__(
        self, admission: Admission, engine: int, *, clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._admission = admission
        self._engine = engine
        self._clock = clock
        self._sleep = sleep

    def pause(self) -> None:
        self._admission.hold(self._engine)

    def resume(self) -> None:
        self._admission.hold(self._engine, False)

    @property
    def in_flight(self) -> int:
        return self._admission.in_flight_on(self._engine)

    async def wait_idle(self, timeout: float) -> bool:
        """Whether the engine's requests all ended within ``timeout`` seconds."""
        deadline = self._clock() + timeout
        while self.in_flight and self._clock() < deadline:
            await self._sleep(DRAIN_POLL)
        return not self.in_flight
