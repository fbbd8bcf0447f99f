"""Each tenant's share of the KV budget: the blocks its requests hold (admitted, or queued for admission) stay
within ``kv_share`` x the budget. A request that would pass it waits, in arrival order behind the tenant's
other waiting requests, until the tenant's own requests give blocks back; it is turned away like the queue
turns requests away: 429 when too many of the tenant's requests wait, 503 after the queue timeout, 400 when it
alone is larger than the share. The share is this replica's: each replica books its own engine's blocks."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from gateway.errors import KVBudgetExceeded, QueueFull, QueueTimeout


@dataclass(slots=True)
class _Waiter:
    blocks: int
    cap: int
    future: asyncio.Future[None]


class ShareGate:
    def __init__(self, *, max_waiting: int, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._max_waiting = max_waiting
        self._timeout = timeout
        self._clock = clock
        self._held: dict[str, int] = {}
        self._waiting: dict[str, deque[_Waiter]] = {}

    def held(self, tenant: str) -> int:
        return self._held.get(tenant, 0)

    @contextlib.asynccontextmanager
    async def hold(self, tenant: str, share: float, blocks: int, budget: int) -> AsyncIterator[float]:
        """Hold ``blocks`` of ``tenant``'s share of ``budget`` while the body runs; yields the seconds waited."""
        cap = int(share * budget)
        if blocks > cap:
            raise KVBudgetExceeded(
                f"Tenant {tenant!r} may hold at most {cap} KV blocks (kv_share {share:g} of a {budget}-block "
                f"budget); this request needs {blocks} blocks. Lower max_tokens or shorten the prompt."
            )
        started = self._clock()
        await self._acquire(tenant, blocks, cap)
        try:
            yield self._clock() - started
        finally:
            self._held[tenant] -= blocks
            self._wake(tenant)

    async def _acquire(self, tenant: str, blocks: int, cap: int) -> None:
        line = self._waiting.setdefault(tenant, deque())
        if not line and self.held(tenant) + blocks <= cap:
            self._held[tenant] = self.held(tenant) + blocks
            return
        if len(line) >= self._max_waiting:
            raise QueueFull(
                f"Tenant {tenant!r} holds {self.held(tenant)} of its {cap} KV blocks and {len(line)} of its "
                f"requests wait for them (the most allowed: {self._max_waiting}); retry later.", retry_after=1.0,
            )
        waiter = _Waiter(blocks, cap, asyncio.get_running_loop().create_future())
        line.append(waiter)
        try:
            async with asyncio.timeout(self._timeout):
                await waiter.future
        except BaseException as exc:
            if waiter.future.done() and not waiter.future.cancelled():
                self._held[tenant] -= blocks  # given its blocks in the instant it gave up: they go back
            else:
                line.remove(waiter)
            self._wake(tenant)  # the line's new head may fit now
            if isinstance(exc, TimeoutError):
                raise QueueTimeout(
                    f"Waited {self._timeout:g} s for tenant {tenant!r}'s share of the KV budget ({cap} blocks, "
                    f"{self.held(tenant)} held); retry later.", retry_after=1.0,
                ) from None
            raise

    def _wake(self, tenant: str) -> None:
        """Admit the tenant's waiting requests, in order, while the head fits."""
        line = self._waiting.get(tenant)
        while line:
            head = line[0]
            if self.held(tenant) + head.blocks > head.cap:
                return
            line.popleft()
            self._held[tenant] = self.held(tenant) + head.blocks
            head.future.set_result(None)
