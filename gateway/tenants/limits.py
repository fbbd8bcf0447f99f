"""A tenant's limits and the fixed one-minute windows that enforce them, in process.

Each tenant has at most four limits: requests per minute, tokens per minute, concurrent requests, and a share
of the KV budget (the last is ``share``'s). The per-minute limits count in fixed windows aligned to the clock's
minutes, so that every gateway replica sharing a clock agrees on where a window starts and ends (``redis``
keeps the same windows for several replicas). A request is charged when it is checked: one request, and its
prompt tokens as counted plus the ``max_tokens`` it books for each sequence; when it ends, the charge is
settled to what it really used. A request over any limit is charged nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

WINDOW_SECONDS = 60.0
LimitName = Literal["requests_per_minute", "tokens_per_minute", "concurrent_requests"]


class TenantLimits(BaseModel):
    """What one tenant may use; an absent limit is no limit."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)
    concurrent_requests: int | None = Field(default=None, ge=1)
    kv_share: float | None = Field(default=None, gt=0.0, le=1.0)

    @property
    def windowed(self) -> bool:
        """Whether a request has anything to check against the windows (else the check costs nothing)."""
        # Read twice a request: ``or`` over the fields, not ``any`` over a generator (a frame of its own each time).
        return self.requests_per_minute is not None or self.tokens_per_minute is not None or \
            self.concurrent_requests is not None


NO_LIMITS = TenantLimits()


def window_of(now: float) -> tuple[int, float]:
    """The index of the window ``now`` falls in, and the seconds left until it ends."""
    index = math.floor(now / WINDOW_SECONDS)
    return index, (index + 1) * WINDOW_SECONDS - now


@dataclass(frozen=True, slots=True)
class Ask:
    """One request's charge: ``tokens`` = prompt tokens as counted + ``max_tokens`` x sequences; ``slot``
    identifies its concurrency slot (unique across replicas)."""

    tenant: str
    limits: TenantLimits
    tokens: int
    slot: str
    now: float


@dataclass(frozen=True, slots=True)
class Standing:
    """A tenant's windows as one check left them: used counts (this request included when it passed), the
    seconds until the window resets, and the limit refused (None: the request was charged)."""

    limits: TenantLimits
    requests: int
    tokens: int
    concurrent: int
    reset: float
    refused: LimitName | None = None

    @property
    def retry_after(self) -> float:
        """Seconds until a retry may pass: the window's end; a concurrency slot has no known end."""
        return 1.0 if self.refused == "concurrent_requests" else max(1.0, self.reset)


@dataclass(frozen=True, slots=True)
class Ticket:
    """What a charged request holds, for its settlement: the window it was charged in and its tokens."""

    tenant: str
    window: int
    tokens: int
    slot: str
    concurrency: bool  # holds a concurrency slot


def refusal(limits: TenantLimits, requests: int, tokens: int, concurrent: int, ask_tokens: int) -> LimitName | None:
    """Which limit one more request of ``ask_tokens`` would break, given the window's counts before it."""
    if limits.requests_per_minute is not None and requests + 1 > limits.requests_per_minute:
        return "requests_per_minute"
    if limits.tokens_per_minute is not None and tokens + ask_tokens > limits.tokens_per_minute:
        return "tokens_per_minute"
    if limits.concurrent_requests is not None and concurrent + 1 > limits.concurrent_requests:
        return "concurrent_requests"
    return None


@dataclass(slots=True)
class _Counts:
    window: int
    requests: int = 0
    tokens: int = 0


class LocalWindows:
    """The windows of every tenant in this process: exact, and lost on restart (a minute's worth at most)."""

    def __init__(self) -> None:
        self._counts: dict[str, _Counts] = {}
        self._running: dict[str, int] = {}

    def take(self, ask: Ask) -> tuple[Standing, Ticket | None]:
        window, reset = window_of(ask.now)
        counts = self._counts.get(ask.tenant)
        if counts is None or counts.window != window:
            counts = self._counts[ask.tenant] = _Counts(window)
        running = self._running.get(ask.tenant, 0)
        refused = refusal(ask.limits, counts.requests, counts.tokens, running, ask.tokens)
        if refused is not None:
            return Standing(ask.limits, counts.requests, counts.tokens, running, reset, refused), None
        counts.requests += 1
        counts.tokens += ask.tokens
        holds = ask.limits.concurrent_requests is not None
        if holds:
            running += 1
            self._running[ask.tenant] = running
        standing = Standing(ask.limits, counts.requests, counts.tokens, running, reset)
        return standing, Ticket(ask.tenant, window, ask.tokens, ask.slot, holds)

    def settle(self, ticket: Ticket, used_tokens: int) -> None:
        """Give back what ``ticket`` booked and did not use (in its own window only: a window that has ended
        no longer limits anyone), and its concurrency slot."""
        counts = self._counts.get(ticket.tenant)
        if counts is not None and counts.window == ticket.window:
            counts.tokens = max(0, counts.tokens - max(0, ticket.tokens - used_tokens))
        if ticket.concurrency:
            self._running[ticket.tenant] = max(0, self._running.get(ticket.tenant, 0) - 1)

    def running(self, tenant: str) -> int:
        return self._running.get(tenant, 0)


# -- OpenAI's rate-limit headers --------------------------------------------------------------------
def ratelimit_headers(standing: Standing) -> dict[str, str]:
    """``x-ratelimit-*`` as OpenAI sends them, for the per-minute limits the tenant has."""
    limits, headers = standing.limits, {}
    reset = duration(standing.reset)
    if limits.requests_per_minute is not None:
        headers["x-ratelimit-limit-requests"] = str(limits.requests_per_minute)
        headers["x-ratelimit-remaining-requests"] = str(max(0, limits.requests_per_minute - standing.requests))
        headers["x-ratelimit-reset-requests"] = reset
    if limits.tokens_per_minute is not None:
        headers["x-ratelimit-limit-tokens"] = str(limits.tokens_per_minute)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, limits.tokens_per_minute - standing.tokens))
        headers["x-ratelimit-reset-tokens"] = reset
    return headers


def duration(seconds: float) -> str:
    """A duration as OpenAI writes it (Go's form): ``"20ms"``, ``"1s"``, ``"8.64s"``, ``"6m0s"``, ``"1h0m0s"``."""
    ms = max(0, round(seconds * 1000))
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"
