"""The per-minute windows, exact to the token: a request is charged its prompt and booked max_tokens when it
is checked, settled to its real usage when it ends, refused (and charged nothing) past a limit; and OpenAI's
x-ratelimit-* headers as OpenAI writes them."""

from __future__ import annotations

import pytest

from gateway.tenants.limits import Ask, LocalWindows, Standing, TenantLimits, duration, ratelimit_headers, window_of

MINUTE_START = 60.0 * 1000  # a clock reading on a window's first instant


def ask(limits: TenantLimits, tokens: int, now: float, slot: str = "s") -> Ask:
    return Ask("search", limits, tokens, slot, now)


def test_the_token_budget_is_exact_to_the_token_and_settling_gives_back_the_unused_tokens() -> None:
    windows = LocalWindows()
    limits = TenantLimits(tokens_per_minute=1000)
    now = MINUTE_START + 1.0
    standing, first = windows.take(ask(limits, 600, now))  # 100 prompt + 500 max_tokens
    assert first is not None and standing.tokens == 600
    standing, refused = windows.take(ask(limits, 401, now))
    assert refused is None and standing.refused == "tokens_per_minute" and standing.tokens == 600
    windows.settle(first, used_tokens=150)  # it generated 50 of its 500
    standing, second = windows.take(ask(limits, 850, now))  # 150 + 850 = 1000: exactly the limit
    assert second is not None and standing.tokens == 1000
    standing, third = windows.take(ask(limits, 1, now))
    assert third is None and standing.refused == "tokens_per_minute"


def test_a_new_window_starts_empty_and_settling_an_old_one_changes_nothing() -> None:
    windows = LocalWindows()
    limits = TenantLimits(tokens_per_minute=100)
    _, old = windows.take(ask(limits, 100, MINUTE_START + 59.9))
    assert old is not None
    standing, fresh = windows.take(ask(limits, 100, MINUTE_START + 60.0))
    assert fresh is not None and standing.tokens == 100
    windows.settle(old, used_tokens=0)  # ended a window ago: the new window keeps its charge
    assert windows.take(ask(limits, 1, MINUTE_START + 61.0))[0].refused == "tokens_per_minute"


def test_requests_per_minute_count_every_charged_request_and_none_refused() -> None:
    windows = LocalWindows()
    limits = TenantLimits(requests_per_minute=2, tokens_per_minute=10)
    now = MINUTE_START
    assert windows.take(ask(limits, 11, now))[1] is None  # refused for tokens: not counted as a request
    assert windows.take(ask(limits, 1, now))[1] is not None
    assert windows.take(ask(limits, 1, now))[1] is not None
    standing, ticket = windows.take(ask(limits, 1, now))
    assert ticket is None and standing.refused == "requests_per_minute" and standing.requests == 2


def test_concurrent_requests_are_slots_given_back_when_a_request_ends() -> None:
    windows = LocalWindows()
    limits = TenantLimits(concurrent_requests=1)
    _, first = windows.take(ask(limits, 5, MINUTE_START))
    assert first is not None
    standing, second = windows.take(ask(limits, 5, MINUTE_START))
    assert second is None and standing.refused == "concurrent_requests" and standing.retry_after == 1.0
    windows.settle(first, used_tokens=5)
    assert windows.take(ask(limits, 5, MINUTE_START))[1] is not None


@pytest.mark.parametrize(
    ("now", "index", "left"), [(0.0, 0, 60.0), (59.5, 0, 0.5), (60.0, 1, 60.0), (MINUTE_START + 23.0, 1000, 37.0)]
)
def test_windows_are_the_clocks_minutes(now: float, index: int, left: float) -> None:
    assert window_of(now) == (index, pytest.approx(left))


def test_retry_after_is_the_time_left_in_the_window() -> None:
    windows = LocalWindows()
    limits = TenantLimits(requests_per_minute=1)
    windows.take(ask(limits, 1, MINUTE_START + 36.6))
    standing, _ = windows.take(ask(limits, 1, MINUTE_START + 36.6))
    assert standing.retry_after == pytest.approx(23.4)


@pytest.mark.parametrize(
    ("seconds", "written"),
    [(0.0, "0ms"), (0.02, "20ms"), (0.9994, "999ms"), (1.0, "1s"), (8.64, "8.64s"), (59.9996, "1m0s"),
     (86.4, "1m26.4s"), (360.0, "6m0s"), (3600.0, "1h0m0s")],
)
def test_durations_are_written_as_openai_writes_them(seconds: float, written: str) -> None:
    assert duration(seconds) == written


def test_the_headers_say_the_limits_what_remains_and_when_it_resets() -> None:
    limits = TenantLimits(requests_per_minute=600, tokens_per_minute=150000)
    standing = Standing(limits, requests=1, tokens=22, concurrent=0, reset=6.0)
    assert ratelimit_headers(standing) == {
        "x-ratelimit-limit-requests": "600", "x-ratelimit-remaining-requests": "599",
        "x-ratelimit-reset-requests": "6s",
        "x-ratelimit-limit-tokens": "150000", "x-ratelimit-remaining-tokens": "149978",
        "x-ratelimit-reset-tokens": "6s",
    }


def test_a_tenant_without_per_minute_limits_sends_no_headers() -> None:
    standing = Standing(TenantLimits(concurrent_requests=3), requests=1, tokens=0, concurrent=1, reset=6.0)
    assert ratelimit_headers(standing) == {}
