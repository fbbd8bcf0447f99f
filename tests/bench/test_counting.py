"""The counting micro-benchmark reports each size it was asked for."""

from __future__ import annotations

from typing import Any

from bench.workloads.counting import bench_counting


def test_bench_counting_reports_each_size(tokenizer: Any) -> None:
    figures = bench_counting(tokenizer, sizes=(300,), repeat=1)
    row = figures["300"]
    assert set(row) == {"tokens", "naive_ms", "cold_ms", "prefix_ms", "warm_ms", "naive_cpu_ms", "cold_cpu_ms"}
    assert 250 <= row["tokens"] <= 450
