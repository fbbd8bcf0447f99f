"""Time the tests control: a clock that moves only when told, and a sleep that returns only when woken."""

from __future__ import annotations

import asyncio


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class ManualSleep:
    """An injectable sleep: records each call and returns only when the test wakes it."""

    def __init__(self) -> None:
        self.delays: list[float] = []
        self.pending: list[asyncio.Future[None]] = []

    async def __call__(self, delay: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.delays.append(delay)
        self.pending.append(fut)
        await fut

    def wake(self) -> None:
        for fut in self.pending:
            if not fut.done():
                fut.set_result(None)
        self.pending.clear()

    async def wake_and_run(self) -> None:
        """Wake the sleepers and let the woken tasks run to their next wait."""
        self.wake()
        for _ in range(3):
            await asyncio.sleep(0)
