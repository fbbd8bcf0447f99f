"""Where a run's time went, read off the servers without running them: histogram means between two scrapes, the
gateway's loop lags, and a client's time to first token split at the gateway's handler by its access log."""

from __future__ import annotations

import datetime

import pytest

from bench.workloads.time_split import (
    ENGINE_TTFT,
    GATEWAY_QUEUE,
    Handled,
    access_lines,
    histogram_totals,
    loop_lags,
    mean_since,
    ttft_split,
)

PAGE = """\
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 1.5
vllm:time_to_first_token_seconds_count{engine="1",model_name="tiny"} 2.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="tiny"} 0.5
"""
LAGS = """# HELP vllm_guard_event_loop_lag_seconds How much later than due the event loop woke a timer.
# TYPE vllm_guard_event_loop_lag_seconds histogram
vllm_guard_event_loop_lag_seconds_bucket{le="0.1"} 90.0
vllm_guard_event_loop_lag_seconds_bucket{le="0.25"} 95.0
vllm_guard_event_loop_lag_seconds_bucket{le="1.0"} 99.0
vllm_guard_event_loop_lag_seconds_bucket{le="+Inf"} 100.0
vllm_guard_event_loop_lag_seconds_count 100.0
vllm_guard_event_loop_lag_seconds_sum 7.5
"""
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


def test_a_histogram_is_summed_over_its_label_sets_and_absent_reads_as_nothing() -> None:
    assert histogram_totals(PAGE, ENGINE_TTFT) == (2.0, 6.0)
    assert histogram_totals(PAGE, GATEWAY_QUEUE) == (0.0, 0.0)


@pytest.mark.parametrize(
    ("before", "now", "mean"),
    [((1.0, 2.0), (4.0, 5.0), 1.0), ((1.0, 2.0), (1.0, 2.0), 0.0), ((0.0, 0.0), (0.25, 1.0), 0.25)],
)
def test_the_mean_between_two_readings_counts_only_what_was_observed_between(
    before: tuple[float, float], now: tuple[float, float], mean: float
) -> None:
    assert mean_since(before, now) == pytest.approx(mean)


@pytest.mark.parametrize(("past", "late"), [(0.25, 5), (0.1, 10), (1.0, 1)])
def test_loop_lags_count_the_observations_past_a_bucket_bound(past: float, late: int) -> None:
    assert loop_lags(LAGS, past) == late
    assert loop_lags("# TYPE other counter\nother_total 3.0\n") == 0


def test_the_access_log_gives_each_answered_requests_start_and_first_write() -> None:
    assert access_lines(LOG) == {"a": Handled(STARTED, 0.25)}


def test_a_clients_ttft_splits_into_before_the_handler_in_it_and_after_its_write() -> None:
    parts = ttft_split([("a", STARTED - 0.5, STARTED + 0.35)], access_lines(LOG))
    assert parts["split_joined"] == 1
    assert (parts["split_before_s"], parts["split_inside_s"], parts["split_after_s"]) == pytest.approx(
        (0.5, 0.25, 0.1))


def test_requests_the_gateway_did_not_log_are_left_out() -> None:
    assert ttft_split([("b", STARTED, STARTED + 1.0), ("zz", STARTED, STARTED + 1.0)], access_lines(LOG)) == {}
