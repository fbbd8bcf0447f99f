"""The relay CPU benchmark's pure parts: per-stream and per-token figures, the loop lag read off a metrics page,
and the report's medians of paired ratios."""

from __future__ import annotations

import argparse

import pytest

from bench.relay_cpu import Run, lag_totals, report

LAGS = """# HELP vllm_guard_event_loop_lag_seconds How much later than due the event loop woke a timer.
# TYPE vllm_guard_event_loop_lag_seconds histogram
vllm_guard_event_loop_lag_seconds_bucket{le="0.1"} 90.0
vllm_guard_event_loop_lag_seconds_bucket{le="+Inf"} 100.0
vllm_guard_event_loop_lag_seconds_count 100.0
vllm_guard_event_loop_lag_seconds_sum 7.5
"""


def run(cpu_s: float, requests: int = 100, events: int = 20_000) -> Run:
    return Run(requests, events, cpu_s, 0, 40.0, 0.3)


def test_a_runs_cpu_is_shared_out_over_its_streams_and_tokens() -> None:
    r = run(1.2)
    assert r.ms_per_request == pytest.approx(12.0)
    assert r.us_per_token == pytest.approx(60.0)


def test_a_run_that_completed_nothing_does_not_divide_by_zero() -> None:
    assert run(1.0, requests=0, events=0).ms_per_request == pytest.approx(1000.0)


def test_the_loop_lag_is_the_histograms_sum_and_count() -> None:
    assert lag_totals(LAGS) == (7.5, 100.0)


def test_a_page_without_the_lag_histogram_reads_as_no_lag() -> None:
    assert lag_totals("# TYPE other counter\nother_total 3.0\n") == (0.0, 0.0)


def test_the_report_gives_the_median_of_the_per_run_ratios_to_this_build() -> None:
    runs = {"now": [run(1.0), run(2.0), run(1.0)], "before": [run(1.5), run(2.0), run(3.0)]}
    text = report(runs, argparse.Namespace(rate=12.0, seconds=20.0, repeat=3))
    before = next(line for line in text.splitlines() if line.startswith("| before"))
    # Per run 1.5x, 1.0x and 3.0x: the median is 1.5x, though the medians' ratio would be 2.0/1.0.
    assert "| 1.50x |" in before
