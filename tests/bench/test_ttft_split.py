"""bench/ttft_split.py's join of what the client saw to the gateway's access log, without servers."""

from __future__ import annotations

import datetime

import pytest

from bench.ttft_split import Handled, Seen, access_lines, split

LOG = """\
INFO:     Started server process [1]
time=2026-11-27T02:40:00.500Z request_id=a tenant=default route=chat model=tiny status=200 outcome=ok reason= \
prompt_tokens=342 max_tokens_asked=1024 max_tokens=1024 truncated_tokens=0 queue_ms=0.2 engine=0 ttft_ms=250.0 \
duration_ms=565.9 completion_tokens=324 trace_id=
time=2026-11-27T02:40:01.000Z request_id=b tenant=default route=chat model=tiny status=503 outcome=refused \
reason=deadline prompt_tokens=300 max_tokens_asked=1024 max_tokens=1024 truncated_tokens=0 queue_ms= engine= \
ttft_ms= duration_ms=3.0 completion_tokens= trace_id=
"""
STARTED = datetime.datetime(2026, 11, 27, 2, 40, 0, 500000, tzinfo=datetime.UTC).timestamp()


def test_the_access_log_gives_each_answered_requests_start_and_first_write() -> None:
    assert access_lines(LOG) == {"a": Handled(STARTED, 0.25)}


def test_a_clients_ttft_splits_into_before_the_handler_in_it_and_after_its_write() -> None:
    parts = split([Seen("a", STARTED - 0.5, STARTED + 0.35)], access_lines(LOG))
    assert parts is not None
    assert parts.joined == 1
    assert (parts.client, parts.before, parts.inside, parts.after) == pytest.approx((0.85, 0.5, 0.25, 0.1))


def test_requests_the_gateway_did_not_log_are_left_out() -> None:
    assert split([Seen("b", STARTED, STARTED + 1.0), Seen("zz", STARTED, STARTED + 1.0)], access_lines(LOG)) is None
