"""The CPU-wait benchmark's pure parts: the kernel's per-thread account of a process, and the loop lags on a
gateway's metrics page."""

from __future__ import annotations

import os
import sys

import pytest

from bench.cpu_waits import Sched, loop_lags, sched

LAGS = """# HELP vllm_guard_event_loop_lag_seconds How much later than due the event loop woke a timer.
# TYPE vllm_guard_event_loop_lag_seconds histogram
vllm_guard_event_loop_lag_seconds_bucket{le="0.1"} 90.0
vllm_guard_event_loop_lag_seconds_bucket{le="0.25"} 95.0
vllm_guard_event_loop_lag_seconds_bucket{le="1.0"} 99.0
vllm_guard_event_loop_lag_seconds_bucket{le="+Inf"} 100.0
vllm_guard_event_loop_lag_seconds_count 100.0
vllm_guard_event_loop_lag_seconds_sum 7.5
"""


@pytest.mark.parametrize(("past", "late"), [(0.25, 5), (0.1, 10), (1.0, 1)])
def test_loop_lags_count_the_observations_past_a_bucket_bound(past: float, late: int) -> None:
    assert loop_lags(LAGS, past) == late


def test_a_page_without_the_lag_histogram_has_no_lags() -> None:
    assert loop_lags("# TYPE other counter\nother_total 3.0\n") == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="schedstat is Linux's")
def test_this_process_ran_and_was_scheduled_by_the_kernels_account() -> None:
    before = sched(os.getpid())
    sum(i * i for i in range(200_000))  # some CPU of its own
    spent = sched(os.getpid()) - before
    assert spent.ran > 0 and spent.slices >= 0 and spent.waited >= 0


def test_accounts_subtract_field_by_field() -> None:
    assert Sched(3.0, 2.0, 10) - Sched(1.0, 0.5, 4) == Sched(2.0, 1.5, 6)
