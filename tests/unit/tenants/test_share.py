"""A tenant's share of the KV budget: its requests hold at most share x budget blocks; the rest wait in
arrival order for the tenant's own blocks, and are turned away as the queue turns requests away."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from gateway.errors import KVBudgetExceeded, QueueFull, QueueTimeout
from gateway.tenants.share import ShareGate

BUDGET, SHARE = 100, 0.3  # a share of 30 blocks


@contextlib.asynccontextmanager
async def holding(gate: ShareGate, blocks: int, tenant: str = "batch") -> AsyncIterator[asyncio.Event]:
    """A request of ``tenant`` holding ``blocks`` until the returned event is set."""
    release, entered = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        async with gate.hold(tenant, SHARE, blocks, BUDGET):
            entered.set()
            await release.wait()

    task = asyncio.create_task(hold())
    await entered.wait()
    try:
        yield release
    finally:
        release.set()
        await task


async def waiting(gate: ShareGate, blocks: int, order: list[int], tenant: str = "batch") -> asyncio.Task[None]:
    async def wait() -> None:
        async with gate.hold(tenant, SHARE, blocks, BUDGET):
            order.append(blocks)

    task = asyncio.create_task(wait())
    await asyncio.sleep(0)
    return task


async def test_requests_within_the_share_pass_at_once_and_others_wait_in_arrival_order() -> None:
    gate, order = ShareGate(max_waiting=8, timeout=5.0), []
    async with holding(gate, 25) as release:
        first = await waiting(gate, 10, order)
        second = await waiting(gate, 3, order)  # would fit, but does not pass the tenant's earlier request
        assert order == [] and gate.held("batch") == 25
        release.set()
        await asyncio.gather(first, second)
    assert order == [10, 3] and gate.held("batch") == 0


async def test_another_tenants_blocks_do_not_count() -> None:
    gate, order = ShareGate(max_waiting=8, timeout=5.0), []
    async with holding(gate, 30):
        await (await waiting(gate, 30, order, tenant="search"))
    assert order == [30]


async def test_a_request_larger_than_the_share_is_refused_at_once_with_the_numbers() -> None:
    gate = ShareGate(max_waiting=8, timeout=5.0)
    with pytest.raises(KVBudgetExceeded, match=r"at most 30 KV blocks \(kv_share 0.3 of a 100-block budget\); "
                                               r"this request needs 31 blocks"):
        async with gate.hold("batch", SHARE, 31, BUDGET):
            pass


async def test_too_many_waiting_requests_are_shed_with_429() -> None:
    gate, order = ShareGate(max_waiting=1, timeout=5.0), []
    async with holding(gate, 30):
        task = await waiting(gate, 5, order)
        with pytest.raises(QueueFull, match="1 of its requests wait"):
            async with gate.hold("batch", SHARE, 5, BUDGET):
                pass
    await task
    assert order == [5]


async def test_a_wait_past_the_timeout_is_a_503_and_leaves_the_line() -> None:
    gate = ShareGate(max_waiting=8, timeout=0.01)
    async with holding(gate, 30):
        with pytest.raises(QueueTimeout, match=r"Waited 0\.01 s for tenant 'batch'") as caught:
            async with gate.hold("batch", SHARE, 5, BUDGET):
                pass
        assert caught.value.retry_after == 1.0
    assert gate.held("batch") == 0


async def test_a_cancelled_waiter_leaves_the_line_and_lets_the_next_one_in() -> None:
    gate, order = ShareGate(max_waiting=8, timeout=5.0), []
    async with holding(gate, 20):
        big = await waiting(gate, 20, order)
        small = await waiting(gate, 10, order)  # fits now, but waits behind the big one
        assert order == []
        big.cancel()
        await asyncio.gather(big, return_exceptions=True)
        await small
        assert order == [10]
    assert gate.held("batch") == 0
