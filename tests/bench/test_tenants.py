"""The tenants benchmark's accounting: the quiet tenant's figures, the requests sent straight to the engine kept
apart from both tenants, and the nearest-rank percentiles over a few dozen samples."""

from __future__ import annotations

import math

import pytest

from bench.benchmarks.tenants import measures
from bench.workloads.tenants import ENGINE, Answer, Run, nearest_rank


def answer(tenant: str, finished: float, ttft: float, tokens: tuple[int, int] = (64, 16)) -> Answer:
    return Answer(tenant, finished - 1.0, finished, True, *tokens, queue_ms=0.0, ttft_s=ttft)


@pytest.mark.parametrize(
    ("ordered", "q", "expected"),
    [
        ([0.1, 0.2, 0.3], 0.50, 0.2),
        ([float(i) for i in range(1, 31)], 0.99, 30.0),  # 30 samples: p99 is the slowest, not past it
        ([float(i) for i in range(1, 31)], 0.50, 15.0),
    ],
)
def test_percentiles_are_taken_by_nearest_rank(ordered: list[float], q: float, expected: float) -> None:
    assert nearest_rank(ordered, q) == expected
    assert math.isnan(nearest_rank([], q))


def test_requests_sent_straight_to_the_engine_give_the_floor_and_count_for_no_tenant() -> None:
    run = Run(
        "fair",
        [
            answer("flood", 5.0, 0.5, (896, 128)),
            answer("quiet", 5.0, 0.04),
            answer("quiet", 6.0, 0.06),
            answer(ENGINE, 5.5, 0.05),
            answer(ENGINE, 6.5, 0.30),
        ],
        window=(0.0, 10.0),
        idle_ttft_s=0.01,
        tenants=[],
    )
    figures = run.figures()
    assert figures["quiet_p50_ttft_s"] == 0.04
    assert figures["floor_p50_ttft_s"] == 0.05
    assert figures["floor_p99_ttft_s"] == 0.30
    assert figures["quiet_answered"] == 2.0
    # Shares and throughput count the two tenants only: the straight requests are the benchmark's probe.
    assert figures["quiet_share"] == pytest.approx(160 / (160 + 1024))
    assert figures["tokens_per_s"] == pytest.approx((128 + 16 + 16) / 10.0)
    assert {m.key for m in measures()} == set(figures)


def test_without_the_floor_its_rows_are_empty() -> None:
    run = Run("fifo", [answer("quiet", 1.0, 0.02)], window=(0.0, 2.0), idle_ttft_s=0.01, tenants=[])
    figures = run.figures()
    assert math.isnan(figures["floor_p50_ttft_s"])
    assert math.isnan(figures["floor_p99_ttft_s"])
