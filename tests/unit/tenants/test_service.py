"""A request's life with its tenant: charged at the check, held within the tenant's KV share while admitted,
settled to what it used when it ends (a stream included, a refused one charged nothing), and its usage
counted; with Redis unreachable, the limits fall back to this replica's own windows and say so once."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from types import TracebackType
from typing import Any, cast

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.config import Settings
from gateway.errors import QueueTimeout, TenantRateLimited
from gateway.metrics import Metrics
from gateway.tenants import Grant, Tenants
from gateway.tenants.limits import Ask, LocalWindows, Standing, TenantLimits, Ticket
from gateway.tenants.redis import RedisWindows, SharedWindows
from tests.support.clock import FakeClock

KEYS = """\
tenants:
  search:
    limits: {tokens_per_minute: 1000, requests_per_minute: 10, concurrent_requests: 2, kv_share: 0.5}
    keys: [sk-search-0f3c9a]
  default:
    limits: {requests_per_minute: 1}
"""


class FakeReservation:
    """A reservation that is admitted at once (or refused, as the queue would), and generates on demand."""

    def __init__(self, blocks: int = 4, refuse: Exception | None = None) -> None:
        self.blocks, self.generated, self.queue_ms = blocks, 0, 12.0
        self.refuse = refuse
        self.entered = self.exited = False

    async def __aenter__(self) -> FakeReservation:
        if self.refuse is not None:
            raise self.refuse
        self.entered = True
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.exited = True


@pytest.fixture
def tenants(tmp_path: Path) -> Tenants:
    path = tmp_path / "keys.yaml"
    path.write_text(KEYS, encoding="utf-8")
    return Tenants(Settings(keys_file=str(path), queue_timeout=0.05), Metrics(), clock=FakeClock(60_000.0),
                   monotonic=FakeClock(0.0))


def tokens_used(tenants: Tenants, tenant: str = "search") -> int:
    windows = cast(LocalWindows, tenants.windows)
    return windows._counts[tenant].tokens


async def test_a_stream_is_charged_its_prompt_and_the_tokens_it_generated_when_it_ends(tenants: Tenants) -> None:
    grant = await tenants.check("search", prompt_tokens=100, output_tokens=500)
    grant.raise_if_refused()
    assert tokens_used(tenants) == 600
    reservation = FakeReservation()
    async with grant.admit(reservation, budget=lambda: 40) as waited_ms:
        assert waited_ms == pytest.approx(12.0)
        for generated in range(1, 51):  # the stream's events, as the exchange teaches the reservation
            reservation.generated = generated
        assert tokens_used(tenants) == 600  # still booked in full while it runs
    grant.settle(queue_ms=12.0)
    assert tokens_used(tenants) == 150
    usage = tenants.report()["tenants"]["search"]  # type: ignore[index]
    assert usage["requests"] == 1 and usage["prompt_tokens"] == 100 and usage["completion_tokens"] == 50
    assert usage["queue_seconds"] == pytest.approx(0.012)


async def test_settling_twice_charges_once(tenants: Tenants) -> None:
    grant = await tenants.check("search", prompt_tokens=10, output_tokens=10)
    async with grant.admit(FakeReservation(), budget=lambda: 40):
        pass
    grant.settle(0.0)
    grant.settle(0.0)
    assert tokens_used(tenants) == 10
    assert tenants.report()["tenants"]["search"]["requests"] == 1  # type: ignore[index]


async def test_a_request_refused_by_the_queue_is_charged_nothing_and_frees_its_slot(tenants: Tenants) -> None:
    grant = await tenants.check("search", prompt_tokens=100, output_tokens=500)
    with pytest.raises(QueueTimeout):
        async with grant.admit(FakeReservation(refuse=QueueTimeout("waited")), budget=lambda: 40):
            pass
    grant.settle(0.0)
    assert tokens_used(tenants) == 0
    assert cast(LocalWindows, tenants.windows).running("search") == 0
    assert tenants.report()["tenants"]["search"]["requests"] == 0  # type: ignore[index]


async def test_generated_tokens_past_the_booking_are_not_charged(tenants: Tenants) -> None:
    grant = await tenants.check("search", prompt_tokens=10, output_tokens=20)
    reservation = FakeReservation()
    async with grant.admit(reservation, budget=lambda: 40):
        reservation.generated = 22  # a stream's closing events counted as tokens
    grant.settle(0.0)
    assert tokens_used(tenants) == 30


async def test_over_a_limit_the_refusal_states_the_limit_and_the_value_and_when_to_retry(tenants: Tenants) -> None:
    await tenants.check("search", prompt_tokens=100, output_tokens=800)
    grant = await tenants.check("search", prompt_tokens=50, output_tokens=100)
    with pytest.raises(TenantRateLimited) as caught:
        grant.raise_if_refused()
    err = caught.value
    assert err.message == (
        "Rate limit reached for tenant 'search' on tokens per minute: limit 1000, 900 tokens used this minute; "
        "this request books 150 (50 prompt + 100 max_tokens). Retry after 60 s."
    )
    assert err.retry_after == pytest.approx(60.0) and err.reason == "tenant_tokens_per_minute"
    assert grant.headers["x-ratelimit-remaining-tokens"] == "100"


async def test_callers_the_file_does_not_name_share_the_default_tenants_limits(tenants: Tenants) -> None:
    (await tenants.check("default", prompt_tokens=1, output_tokens=1)).raise_if_refused()
    with pytest.raises(TenantRateLimited, match="tenant 'default' on requests per minute: limit 1"):
        (await tenants.check("default", prompt_tokens=1, output_tokens=1)).raise_if_refused()


async def test_the_kv_share_makes_a_tenants_requests_wait_for_its_own_blocks(tenants: Tenants) -> None:
    first = await tenants.check("search", prompt_tokens=1, output_tokens=1)
    second = await tenants.check("search", prompt_tokens=1, output_tokens=1)
    entered = asyncio.Event()
    release = asyncio.Event()

    async def hold() -> None:
        async with first.admit(FakeReservation(blocks=15), budget=lambda: 40):  # a share of 20 blocks
            entered.set()
            await release.wait()

    holder = asyncio.create_task(hold())
    await entered.wait()
    waiting = FakeReservation(blocks=10)

    async def wait_for_share() -> None:
        async with second.admit(waiting, budget=lambda: 40):
            pass

    waiter = asyncio.create_task(wait_for_share())
    await asyncio.sleep(0)
    assert not waiting.entered and tenants.share.held("search") == 15
    release.set()
    await asyncio.gather(holder, waiter)
    assert waiting.entered and tenants.share.held("search") == 0


async def test_a_gateway_without_tenants_admits_as_the_reservation_does() -> None:
    grant = Grant.unlimited()
    reservation = FakeReservation()
    async with grant.admit(reservation, budget=lambda: 1) as waited_ms:
        assert reservation.entered and waited_ms == 12.0
    grant.settle(0.0)
    assert reservation.exited and grant.headers == {}


# -- degraded mode ----------------------------------------------------------------------------------
class FlakyRedis:
    """Stands in for RedisWindows: refuses connections while ``down``."""

    def __init__(self) -> None:
        self.down = False
        self.calls = 0
        self.windows = LocalWindows()

    async def take(self, ask: Ask) -> tuple[Standing, Ticket | None]:
        self.calls += 1
        if self.down:
            raise RedisConnectionError("Connection refused")
        return self.windows.take(ask)

    async def settle_many(self, settled: list[tuple[Ticket, int]]) -> None:
        if self.down:
            raise RedisConnectionError("Connection refused")
        for ticket, used_tokens in settled:
            self.windows.settle(ticket, used_tokens)

    async def close(self) -> None:
        pass


def ask(slot: str, now: float = 60_000.0) -> Ask:
    return Ask("search", TenantLimits(requests_per_minute=100), 1, slot, now)


async def test_unreachable_redis_falls_back_to_local_limits_with_one_log_line_each_way(
    caplog: pytest.LogCaptureFixture
) -> None:
    remote, clock, changes = FlakyRedis(), FakeClock(0.0), []
    shared = SharedWindows(cast(RedisWindows, cast(Any, remote)), "redis://:hunter22@cache:6379/0",
                           on_degraded=changes.append, clock=clock)
    with caplog.at_level(logging.WARNING):
        assert (await shared.take(ask("a")))[1] is not None and not shared.degraded
        remote.down = True
        for i in range(3):  # a request never fails because Redis did
            standing, ticket = await shared.take(ask(f"b{i}"))
            assert ticket is not None and standing.refused is None
        assert shared.degraded and remote.calls == 2  # one failed try, then local until the retry time
        clock.now += 5.0
        remote.down = False
        assert (await shared.take(ask("c")))[1] is not None and not shared.degraded
    assert changes == [True, False]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "unreachable" in lines[0] and "reachable again" in lines[1]
    assert all("hunter22" not in line for line in lines)


async def test_a_request_charged_locally_is_settled_locally_and_one_charged_in_redis_in_redis() -> None:
    remote, clock = FlakyRedis(), FakeClock(0.0)
    shared = SharedWindows(cast(RedisWindows, cast(Any, remote)), "redis://cache", on_degraded=lambda d: None,
                           clock=clock)
    limits = TenantLimits(concurrent_requests=1)
    _, in_redis = await shared.take(Ask("search", limits, 1, "r", 60_000.0))
    remote.down = True
    _, local = await shared.take(Ask("search", limits, 1, "l", 60_000.0))
    assert in_redis is not None and local is not None
    shared.settle(local, 1)
    assert shared.local.running("search") == 0 and remote.windows.running("search") == 1
    remote.down = False
    shared.settle(in_redis, 1)
    await shared.close()  # sends the settlements still waiting
    assert remote.windows.running("search") == 0
