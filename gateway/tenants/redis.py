"""Windows shared by several gateway replicas through Redis (``--redis-url``), with a degraded mode.

One Lua script checks and charges a request atomically: the tenant's request and token counters of the
current minute (keys that expire by themselves shortly after the minute ends) and its concurrency slots (a
sorted set of slot ids scored by their lease's end, so that a replica that dies mid-request frees its slots
when the lease runs out). Keys carry the tenant in braces, ``vllm-guard:{tenant}:...``, so that one tenant's
keys share a Redis Cluster slot as a script needs.

When Redis cannot be reached or answers late, ``SharedWindows`` falls back to this replica's own windows
(degraded mode: each replica then enforces the limits alone), sets a gauge and logs one line; it tries Redis
again every few seconds and logs one line when it is back. A request never fails because Redis did.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable
from typing import Any, cast

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.redact import redact_url
from gateway.tenants.limits import Ask, LimitName, LocalWindows, Standing, Ticket, window_of

log = logging.getLogger(__name__)

KEY_PREFIX = "vllm-guard"
# A Redis that answers slower than this is as good as down: the request path does not wait for it.
REDIS_TIMEOUT_SECONDS = 0.5
RETRY_SECONDS = 5.0  # how often degraded mode tries Redis again

# KEYS: requests counter, tokens counter, concurrency set.
# ARGV: rpm, tpm, concurrency (0: none), tokens, counters' ttl ms, now ms, lease end ms, slot id, lease ms.
# Times in ARGV are the gateway's clock (scores); expiries are relative, so Redis's own clock needs no agreement.
TAKE = """
local rpm, tpm, conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tokens, now = tonumber(ARGV[4]), tonumber(ARGV[6])
local running = 0
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  running = redis.call('ZCARD', KEYS[3])
end
local req = tonumber(redis.call('GET', KEYS[1]) or '0')
local tok = tonumber(redis.call('GET', KEYS[2]) or '0')
local refused = ''
if rpm > 0 and req + 1 > rpm then refused = 'requests_per_minute'
elseif tpm > 0 and tok + tokens > tpm then refused = 'tokens_per_minute'
elseif conc > 0 and running + 1 > conc then refused = 'concurrent_requests' end
if refused == '' then
  req = redis.call('INCR', KEYS[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
  tok = redis.call('INCRBY', KEYS[2], tokens)
  redis.call('PEXPIRE', KEYS[2], ARGV[5])
  if conc > 0 then
    redis.call('ZADD', KEYS[3], ARGV[7], ARGV[8])
    redis.call('PEXPIRE', KEYS[3], ARGV[9])
    running = running + 1
  end
end
return {refused, req, tok, running}
"""

# KEYS: tokens counter, concurrency set. ARGV: tokens to give back, slot id.
SETTLE = """
local back = tonumber(ARGV[1])
if back > 0 and redis.call('EXISTS', KEYS[1]) == 1 then
  if redis.call('DECRBY', KEYS[1], back) < 0 then redis.call('SET', KEYS[1], 0, 'KEEPTTL') end
end
redis.call('ZREM', KEYS[2], ARGV[2])
return 1
"""


def keys_for(tenant: str, window: int) -> list[str]:
    base = f"{KEY_PREFIX}:{{{tenant}}}"
    return [f"{base}:requests:{window}", f"{base}:tokens:{window}", f"{base}:concurrent"]


class RedisWindows:
    """The windows in Redis. ``lease``: the longest a request can hold a concurrency slot."""

    def __init__(self, client: Redis, lease: float) -> None:
        self._client = client
        self._lease = lease
        self._take = client.register_script(TAKE)
        self._settle = client.register_script(SETTLE)

    @classmethod
    def connect(cls, url: str, lease: float) -> RedisWindows:
        client = Redis.from_url(
            url, socket_timeout=REDIS_TIMEOUT_SECONDS, socket_connect_timeout=REDIS_TIMEOUT_SECONDS,
            retry=Retry(NoBackoff(), 0),  # degraded mode is the fallback: no retrying on the request path
        )
        return cls(client, lease)

    async def take(self, ask: Ask) -> tuple[Standing, Ticket | None]:
        window, reset = window_of(ask.now)
        lim = ask.limits
        ttl_ms = math.ceil(reset * 1000) + 1000
        args: list[int | str] = [
            lim.requests_per_minute or 0, lim.tokens_per_minute or 0, lim.concurrent_requests or 0, ask.tokens,
            ttl_ms, math.floor(ask.now * 1000), math.ceil((ask.now + self._lease) * 1000), ask.slot,
            math.ceil(self._lease * 1000),
        ]
        async with asyncio.timeout(REDIS_TIMEOUT_SECONDS):
            reply = cast(list[Any], await self._take(keys=keys_for(ask.tenant, window), args=args))
        refused_raw, requests, tokens, running = reply
        refused = (refused_raw.decode() if isinstance(refused_raw, bytes) else str(refused_raw)) or None
        standing = Standing(lim, int(requests), int(tokens), int(running), reset, cast(LimitName | None, refused))
        if refused is not None:
            return standing, None
        return standing, Ticket(ask.tenant, window, ask.tokens, ask.slot, lim.concurrent_requests is not None)

    async def settle(self, ticket: Ticket, used_tokens: int) -> None:
        await self.settle_many([(ticket, used_tokens)])

    async def settle_many(self, settled: list[tuple[Ticket, int]]) -> None:
        """Settle several requests in one round trip (a pipeline of the script, not a transaction: each
        settlement stands alone)."""
        async with asyncio.timeout(REDIS_TIMEOUT_SECONDS), self._client.pipeline(transaction=False) as pipe:
            for ticket, used_tokens in settled:
                keys = keys_for(ticket.tenant, ticket.window)
                args: list[int | str] = [max(0, ticket.tokens - used_tokens), ticket.slot]
                await self._settle(keys=[keys[1], keys[2]], args=args, client=pipe)
            await pipe.execute()

    async def close(self) -> None:
        await self._client.aclose()


class SharedWindows:
    """Redis when it answers, this replica's own windows when it does not. ``on_degraded`` is told of each
    change (True: degraded). Settlements go to Redis from one background task, batched, so that a burst of
    requests ending together costs a round trip rather than a connection each."""

    def __init__(self, remote: RedisWindows, url: str, *, on_degraded: Callable[[bool], None],
                 clock: Callable[[], float]) -> None:
        self.remote = remote
        self.local = LocalWindows()
        self._url = redact_url(url)
        self._on_degraded = on_degraded
        self._clock = clock  # monotonic: when to try Redis again
        self._retry_at: float | None = None  # set while degraded
        self._remote_tickets: set[str] = set()  # slots charged in Redis, to settle there
        self._settling: asyncio.Queue[tuple[Ticket, int]] = asyncio.Queue()
        self._worker: asyncio.Task[None] | None = None

    @property
    def degraded(self) -> bool:
        return self._retry_at is not None

    async def take(self, ask: Ask) -> tuple[Standing, Ticket | None]:
        if self._retry_at is None or self._clock() >= self._retry_at:
            try:
                standing, ticket = await self.remote.take(ask)
            except (RedisError, OSError, TimeoutError) as exc:
                self._degrade(exc)
            else:
                self._recover()
                if ticket is not None:
                    self._remote_tickets.add(ticket.slot)
                return standing, ticket
        return self.local.take(ask)

    def settle(self, ticket: Ticket, used_tokens: int) -> None:
        """Synchronous: a ticket charged here is settled at once, one charged in Redis by the background task."""
        if ticket.slot not in self._remote_tickets:
            self.local.settle(ticket, used_tokens)
            return
        self._remote_tickets.discard(ticket.slot)
        self._settling.put_nowait((ticket, used_tokens))
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._settle_in_batches(), name="redis-settle")

    async def _settle_in_batches(self) -> None:
        while True:
            batch = [await self._settling.get()]
            while not self._settling.empty():
                batch.append(self._settling.get_nowait())
            try:
                await self.remote.settle_many(batch)
            except (RedisError, OSError, TimeoutError) as exc:
                # The windows' counters and the slots' leases expire by themselves.
                self._degrade(exc)
            for _ in batch:
                self._settling.task_done()

    def _degrade(self, exc: BaseException) -> None:
        if self._retry_at is None:
            log.warning("Redis at %s is unreachable (%s): tenant limits are enforced by this replica alone "
                        "until it is back", self._url, type(exc).__name__)
            self._on_degraded(True)
        self._retry_at = self._clock() + RETRY_SECONDS

    def _recover(self) -> None:
        if self._retry_at is not None:
            self._retry_at = None
            log.warning("Redis at %s is reachable again: tenant limits are shared again", self._url)
            self._on_degraded(False)

    async def close(self, drain_timeout: float = 2.0) -> None:
        """Send the settlements still waiting (within ``drain_timeout``), then close the client."""
        if self._worker is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(drain_timeout):
                    await self._settling.join()
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        await self.remote.close()
