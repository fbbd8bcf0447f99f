"""The first-token micro-benchmark prices a sample at each rate it was asked for, with the window's size."""

from __future__ import annotations

from bench.workloads import first_tokens


def test_each_rate_is_priced_with_the_values_its_window_holds() -> None:
    us, held = first_tokens.per_sample(200.0, 500)
    assert us > 0 and held == 2000
