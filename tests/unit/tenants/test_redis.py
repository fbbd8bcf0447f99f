"""The windows in a real redis-server: two replicas charge one budget atomically and exactly, settle it, hold
concurrency slots whose leases run out, and leave keys that expire by themselves."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
from redis.asyncio import Redis

from gateway.tenants import redis as redis_windows
from gateway.tenants.limits import Ask, TenantLimits
from gateway.tenants.redis import RedisWindows, keys_for
from tests.support.redis_server import RedisServer, running_redis

NOW = 60_000.0 + 20.0  # 40 s left in the window


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
async def replicas(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[RedisWindows, RedisWindows]]:
    # These tests are about atomicity and exactness, not about a slow Redis: the request path's 0.5 s bound
    # (past it Redis counts as down) would fail them on a machine busy with other work, where 60 charges
    # opening their connections at once took longer. Degraded mode has tests of its own.
    monkeypatch.setattr(redis_windows, "REDIS_TIMEOUT_SECONDS", 30.0)
    a, b = RedisWindows.connect(server.url, lease=30.0), RedisWindows.connect(server.url, lease=30.0)
    client = Redis.from_url(server.url)
    await client.flushall()
    await client.aclose()
    yield a, b
    await a.close()
    await b.close()


def ask(limits: TenantLimits, tokens: int, slot: str, now: float = NOW) -> Ask:
    return Ask("search", limits, tokens, slot, now)


async def test_two_replicas_share_one_token_budget_exact_to_the_token(
    replicas: tuple[RedisWindows, RedisWindows]
) -> None:
    a, b = replicas
    limits = TenantLimits(tokens_per_minute=1000)
    standing, first = await a.take(ask(limits, 600, "a1"))
    assert first is not None and standing.tokens == 600 and standing.reset == pytest.approx(40.0)
    standing, refused = await b.take(ask(limits, 401, "b1"))
    assert refused is None and standing.refused == "tokens_per_minute"
    await a.settle(first, used_tokens=150)
    assert (await b.take(ask(limits, 850, "b2")))[1] is not None
    standing, last = await a.take(ask(limits, 1, "a2"))
    assert last is None and standing.tokens == 1000


async def test_concurrent_charges_never_pass_the_limit(replicas: tuple[RedisWindows, RedisWindows]) -> None:
    a, b = replicas
    limits = TenantLimits(requests_per_minute=25)
    results = await asyncio.gather(*(r.take(ask(limits, 1, f"s{i}")) for i in range(30) for r in (a, b)))
    assert sum(1 for _, ticket in results if ticket is not None) == 25


async def test_a_concurrency_slot_is_freed_by_settling_or_by_its_lease(
    replicas: tuple[RedisWindows, RedisWindows]
) -> None:
    a, b = replicas
    limits = TenantLimits(concurrent_requests=1)
    _, held = await a.take(ask(limits, 1, "a1"))
    assert held is not None
    assert (await b.take(ask(limits, 1, "b1")))[0].refused == "concurrent_requests"
    await a.settle(held, 1)
    _, crashed = await b.take(ask(limits, 1, "b2"))  # a replica that dies now never settles it
    assert crashed is not None
    assert (await a.take(ask(limits, 1, "a2", now=NOW + 29.0)))[0].refused == "concurrent_requests"
    assert (await a.take(ask(limits, 1, "a3", now=NOW + 31.0)))[1] is not None  # the lease ran out


async def test_the_keys_expire_by_themselves(server: RedisServer, replicas: tuple[RedisWindows, RedisWindows]) -> None:
    a, _ = replicas
    await a.take(ask(TenantLimits(requests_per_minute=5, tokens_per_minute=50, concurrent_requests=2), 3, "a1"))
    client = Redis.from_url(server.url)
    try:
        ttls = [await client.pttl(key) for key in keys_for("search", 1000)]
    finally:
        await client.aclose()
    # Each counter lives until its window's end (40 s from NOW) and one more second; the slots until the lease.
    assert all(39_000 < ttl <= 41_000 for ttl in ttls[:2])
    assert 29_000 < ttls[2] <= 30_000


def test_keys_of_one_tenant_share_a_cluster_slot() -> None:
    assert all("{search}" in key for key in keys_for("search", 7))
