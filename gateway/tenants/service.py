"""The tenants component: who a key belongs to, whether a request is within its tenant's limits, and what the
tenant used. One per gateway; it owns the keys file's reload task and the Redis client, and closes both.

A request meets it twice: ``check`` charges the tenant's windows before admission (and answers the
``x-ratelimit-*`` headers), and the ``Grant`` it returns holds the tenant's share of the KV budget around the
reservation, then settles the charge to the real usage when the request ends, however it ends.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Protocol

from gateway.config import Settings
from gateway.errors import TenantRateLimited
from gateway.metrics import Metrics
from gateway.periodic import Periodic
from gateway.tenants.keys import DEFAULT_TENANT, KeyDirectory, KeysFile, Tenant
from gateway.tenants.limits import Ask, LocalWindows, Standing, Ticket, ratelimit_headers
from gateway.tenants.redis import RedisWindows, SharedWindows
from gateway.tenants.share import ShareGate
from gateway.tenants.usage import UsageBook

log = logging.getLogger(__name__)

LIMIT_WORDS = {
    "requests_per_minute": "requests per minute",
    "tokens_per_minute": "tokens per minute",
    "concurrent_requests": "concurrent requests",
}


_NO_KEYS = KeyDirectory()  # a gateway without a keys file: read for every request, built once (it is never changed)


class Booked(Protocol):
    """A reservation, as a grant sees it: entered to be admitted, its blocks, what it generated."""

    @property
    def blocks(self) -> int: ...
    @property
    def generated(self) -> int: ...
    @property
    def queue_ms(self) -> float: ...
    async def __aenter__(self) -> object: ...
    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


class Tenants:
    def __init__(
        self, settings: Settings, metrics: Metrics, *, clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._metrics = metrics
        self._clock = clock
        self._file = KeysFile(settings.keys_file, on_reload=metrics.record_keys_reload) if settings.keys_file else None
        self.usage = UsageBook(metrics, clock)
        self.share = ShareGate(max_waiting=settings.max_queue, timeout=settings.queue_timeout, clock=monotonic)
        self.windows: LocalWindows | SharedWindows = LocalWindows()
        if settings.redis_url:
            # A slot is held at most for a request's whole life: its queue wait and its upstream time.
            lease = settings.queue_timeout + settings.request_timeout + 60.0
            self.windows = SharedWindows(
                RedisWindows.connect(settings.redis_url, lease), settings.redis_url,
                on_degraded=metrics.record_tenant_limits_degraded, clock=monotonic,
            )
        self._slot_prefix = secrets.token_hex(6)  # concurrency slots are unique across replicas
        self._slots = itertools.count(1)
        self._watch: Periodic | None = None

    # -- keys ---------------------------------------------------------------------------------------
    @property
    def directory(self) -> KeyDirectory:
        return self._file.current if self._file is not None else _NO_KEYS

    def identify(self, digest: bytes) -> Tenant | None:
        """The tenant of the keys file's key with this SHA-256 digest (compared with every key)."""
        return self.directory.find(digest)

    def tenant(self, name: str) -> Tenant:
        return self.directory.tenant(name)

    # -- lifetime -----------------------------------------------------------------------------------
    async def start(self, poll_interval: float | None = None) -> None:
        if self._file is not None and self._watch is None:
            self._watch = self._file.watcher() if poll_interval is None else self._file.watcher(poll_interval)
            self._watch.start()

    async def close(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            await watch.stop()
        if isinstance(self.windows, SharedWindows):
            await self.windows.close()

    # -- the request path ---------------------------------------------------------------------------
    async def check(self, tenant_name: str, *, prompt_tokens: int, output_tokens: int) -> Grant:
        """Charge one request to its tenant's windows: ``prompt_tokens`` as counted, ``output_tokens`` the
        ``max_tokens`` booked for all its sequences. A refused grant raises on ``raise_if_refused``."""
        tenant, windows = self.tenant(tenant_name), self.windows
        if tenant.limits.windowed and isinstance(windows, SharedWindows):
            standing, ticket = await windows.take(self._ask(tenant, prompt_tokens + output_tokens))
            return Grant(self, tenant, prompt_tokens, output_tokens, standing, ticket)
        return self._check_here(tenant, windows, prompt_tokens, output_tokens)

    def check_now(self, tenant_name: str, *, prompt_tokens: int, output_tokens: int) -> Grant | None:
        """``check`` where it needs no round trip to Redis (a tenant without per-minute limits, or windows kept
        here); None where it does."""
        tenant, windows = self.tenant(tenant_name), self.windows
        if tenant.limits.windowed and isinstance(windows, SharedWindows):
            return None
        return self._check_here(tenant, windows, prompt_tokens, output_tokens)

    def _check_here(self, tenant: Tenant, windows: LocalWindows | SharedWindows, prompt_tokens: int,
                    output_tokens: int) -> Grant:
        standing: Standing | None = None
        ticket: Ticket | None = None
        if tenant.limits.windowed and isinstance(windows, LocalWindows):
            standing, ticket = windows.take(self._ask(tenant, prompt_tokens + output_tokens))
        return Grant(self, tenant, prompt_tokens, output_tokens, standing, ticket)

    def _ask(self, tenant: Tenant, tokens: int) -> Ask:
        return Ask(tenant.name, tenant.limits, tokens, f"{self._slot_prefix}-{next(self._slots)}", self._clock())

    def settle(self, ticket: Ticket, used_tokens: int) -> None:
        """Synchronous: it runs where a request ends, in tasks that may be cancelled (a client gone). Redis
        is told in the background (``SharedWindows``), by a task this component closes."""
        self.windows.settle(ticket, used_tokens)

    def report(self) -> dict[str, object]:
        """``GET /guard/usage``: what each tenant used, with its limits (never its keys)."""
        directory = self.directory
        names = [DEFAULT_TENANT, *directory.tenants]
        store = "local"
        if isinstance(self.windows, SharedWindows):
            store = "local (redis unreachable)" if self.windows.degraded else "redis"
        tenants: dict[str, object] = {}
        for name, usage in self.usage.report(names).items():
            tenant = directory.tenant(name)
            tenants[name] = {
                **usage, "weight": tenant.weight, "priority": tenant.priority,
                "limits": tenant.limits.model_dump(exclude_none=True), "kv_share_blocks": self.share.held(name),
            }
        return {"since": self.usage.since, "limits_store": store, "tenants": tenants}


class Grant:
    """One request's standing with its tenant, from its check to its end."""

    def __init__(
        self, tenants: Tenants | None, tenant: Tenant, prompt_tokens: int, output_tokens: int,
        standing: Standing | None, ticket: Ticket | None,
    ) -> None:
        self._tenants = tenants
        self.tenant = tenant
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.standing = standing
        self._ticket = ticket
        self._booked: Booked | None = None  # the reservation last admitted (a retried request has two)
        self._queue_ms = 0.0
        self._settled = False

    @classmethod
    def unlimited(cls) -> Grant:
        """The grant of a gateway without tenants: admits as the reservation does, settles nothing."""
        return cls(None, Tenant(DEFAULT_TENANT), 0, 0, None, None)

    @property
    def headers(self) -> dict[str, str]:
        return ratelimit_headers(self.standing) if self.standing is not None else {}

    def raise_if_refused(self) -> None:
        st = self.standing
        if st is None or st.refused is None:
            return
        limit = getattr(self.tenant.limits, st.refused)
        if st.refused == "requests_per_minute":
            used = f"{st.requests} requests made this minute"
        elif st.refused == "tokens_per_minute":
            used = (f"{st.tokens} tokens used this minute; this request books {self.prompt_tokens + self.output_tokens}"
                    f" ({self.prompt_tokens} prompt + {self.output_tokens} max_tokens)")
        else:
            used = f"{st.concurrent} requests in flight"
        raise TenantRateLimited(
            f"Rate limit reached for tenant {self.tenant.name!r} on {LIMIT_WORDS[st.refused]}: limit {limit}, "
            f"{used}. Retry after {math.ceil(st.retry_after)} s.", limit=st.refused, retry_after=st.retry_after,
        )

    def admit(self, booked: Booked, budget: Callable[[], int | None]) -> AbstractAsyncContextManager[float]:
        """Enter ``booked`` (which may queue) within the tenant's KV share of ``budget()`` blocks (asked only
        of a tenant with a share; None: capacity unknown, no share applies); yields the milliseconds waited."""
        return self._admit(booked, budget)

    def plain(self, budget_of: Callable[[], int | None]) -> bool:
        """Whether ``admit`` is the reservation's own admission alone (no KV share to hold): a holder without a
        task (the workers' authority) may then enter the reservation itself, and tell the grant (``entered``)."""
        share = self.tenant.limits.kv_share
        return self._tenants is None or share is None or budget_of() is None

    def entered(self, booked: Booked) -> None:
        """``booked`` was admitted plainly (``plain``) by its holder: what ``settle`` charges."""
        self._booked = booked

    @contextlib.asynccontextmanager
    async def _admit(self, booked: Booked, budget_of: Callable[[], int | None]) -> AsyncIterator[float]:
        share = self.tenant.limits.kv_share
        budget = budget_of() if self._tenants is not None and share is not None else None
        if self._tenants is None or share is None or budget is None:  # ``plain``
            async with booked:
                self._booked = booked
                yield booked.queue_ms
            return
        async with self._tenants.share.hold(self.tenant.name, share, booked.blocks, budget) as waited, booked:
            self._booked = booked
            yield waited * 1000.0 + booked.queue_ms

    def settle(self, queue_ms: float) -> None:
        """Once, when the request ends: charge what it really used (prompt tokens and the tokens generated, at
        most those booked; nothing when it never reached the engine), free its concurrency slot, and count
        its usage."""
        if self._settled or self._tenants is None:
            return
        self._settled = True
        booked = self._booked
        generated = min(booked.generated, self.output_tokens) if booked is not None else 0
        used = self.prompt_tokens + generated if booked is not None else 0
        if self._ticket is not None:
            self._tenants.settle(self._ticket, used)
        if booked is not None:
            self._tenants.usage.served(self.tenant.name, self.prompt_tokens, generated, queue_ms / 1000.0)
