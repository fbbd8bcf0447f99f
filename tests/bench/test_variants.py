"""bench/variants.py's pieces that need no engine: targets as given, and where a first token's time went."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.variants import (
    ENGINE_QUEUE,
    ENGINE_TTFT,
    GATEWAY_LAG,
    GATEWAY_QUEUE,
    GATEWAY_TTFT,
    histogram_totals,
    mean_since,
    server_of,
    split_target,
    time_split,
)
from tests.e2e.servers import ServerProcess

PAGE = """\
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 1.5
vllm:time_to_first_token_seconds_count{engine="1",model_name="tiny"} 2.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="tiny"} 0.5
"""


@pytest.mark.parametrize(
    ("spec", "path", "flags"),
    [
        ("/tmp/gw-a", "/tmp/gw-a", []),
        ("/tmp/gw-a::--preemption-budget=4", "/tmp/gw-a", ["--preemption-budget=4"]),
        ("/tmp/gw-a::--a=1,--b", "/tmp/gw-a", ["--a=1", "--b"]),
    ],
)
def test_a_target_is_a_checkout_and_the_flags_after_its_double_colon(spec: str, path: str, flags: list[str]) -> None:
    assert split_target(spec) == (Path(path), flags)


def test_a_histogram_is_summed_over_its_label_sets() -> None:
    assert histogram_totals(PAGE, ENGINE_TTFT) == (2.0, 6.0)


def test_a_histogram_absent_reads_as_nothing_observed() -> None:
    assert histogram_totals(PAGE, GATEWAY_QUEUE) == (0.0, 0.0)


@pytest.mark.parametrize(
    ("before", "now", "mean"),
    [((1.0, 2.0), (4.0, 5.0), 1.0), ((1.0, 2.0), (1.0, 2.0), 0.0), ((0.0, 0.0), (0.25, 1.0), 0.25)],
)
def test_the_mean_between_two_readings_counts_only_what_was_observed_between(
    before: tuple[float, float], now: tuple[float, float], mean: float
) -> None:
    assert mean_since(before, now) == pytest.approx(mean)


def test_the_gateways_metrics_are_read_from_the_gateway_and_vllms_from_vllm() -> None:
    engine = ServerProcess("vLLM", [], 1, Path("/dev/null"))
    gateway = ServerProcess("gateway", [], 2, Path("/dev/null"))
    assert server_of(GATEWAY_QUEUE, engine, gateway) is gateway
    assert server_of(ENGINE_TTFT, engine, gateway) is engine
    assert server_of(GATEWAY_QUEUE, engine, None) is engine


def test_a_run_straight_to_vllm_tells_vllms_own_times_only() -> None:
    split = time_split({ENGINE_TTFT: 0.05, ENGINE_QUEUE: 0.01})
    assert split == "vLLM's own TTFT 0.05 s, of it in vLLM's queue 0.01 s"


def test_a_run_through_the_gateway_also_tells_its_wait_its_exchange_and_its_loops_lateness() -> None:
    split = time_split({ENGINE_TTFT: 0.05, ENGINE_QUEUE: 0.01, GATEWAY_QUEUE: 0.03, GATEWAY_TTFT: 0.24,
                        GATEWAY_LAG: 0.0351})
    assert "admission wait 0.03 s" in split and "first event it read 0.24 s" in split and "late by 35 ms" in split
