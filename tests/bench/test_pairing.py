"""Runs in turns: every target once a turn, the order rotating, and comparisons as medians of per-turn ratios."""

from __future__ import annotations

import math

import pytest

from bench.harness.pairing import (
    comparisons,
    in_turns,
    median,
    median_delta,
    median_ratio,
    medians,
    nearest_rank,
    rotated,
)


@pytest.mark.parametrize(
    ("turn", "order"),
    [(0, ["engine", "gateway", "router"]), (1, ["gateway", "router", "engine"]), (2, ["router", "engine", "gateway"]),
     (3, ["engine", "gateway", "router"])],
)
def test_the_order_rotates_by_one_place_a_turn(turn: int, order: list[str]) -> None:
    assert rotated(["engine", "gateway", "router"], turn) == order


def test_every_target_runs_once_a_turn_in_the_rotating_order() -> None:
    calls: list[tuple[str, int]] = []

    def measure(target: str, turn: int) -> dict[str, float]:
        calls.append((target, turn))
        return {"x": float(turn)}

    runs = in_turns(["a", "b"], 3, measure)
    assert calls == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]
    assert runs == {"a": [{"x": 0.0}, {"x": 1.0}, {"x": 2.0}], "b": [{"x": 0.0}, {"x": 1.0}, {"x": 2.0}]}


def test_no_turn_at_all_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        in_turns(["a"], 0, lambda t, n: {})


def test_a_comparison_is_the_median_of_per_turn_ratios_not_the_ratio_of_medians() -> None:
    runs = {"gateway": [{"ms": 3.0}, {"ms": 4.0}, {"ms": 9.0}], "engine": [{"ms": 1.0}, {"ms": 4.0}, {"ms": 3.0}]}
    # Per turn 3.0x, 1.0x and 3.0x: the median is 3.0x, where the medians' ratio would be 4/3.
    assert median_ratio(runs, "gateway", "engine", "ms") == 3.0
    assert median_delta(runs, "gateway", "engine", "ms") == 2.0


def test_turns_with_an_unknown_figure_or_a_zero_base_are_left_out_of_a_ratio() -> None:
    runs = {"t": [{"x": 2.0}, {"x": math.nan}, {"x": 5.0}], "b": [{"x": 1.0}, {"x": 1.0}, {"x": 0.0}]}
    assert median_ratio(runs, "t", "b", "x") == 2.0
    assert math.isnan(median_ratio(runs, "t", "b", "missing"))


def test_medians_and_quantiles_skip_unknown_values() -> None:
    assert median([3.0, math.nan, 1.0]) == 2.0
    assert math.isnan(median([]))
    assert nearest_rank([float(i) for i in range(1, 101)], 0.99) == 99.0
    assert nearest_rank([0.1, 0.2, 0.3], 0.5) == 0.2
    assert medians({"a": [{"x": 1.0}, {"x": 3.0}, {"x": 2.0}]}) == {"a": {"x": 2.0}}


def test_every_target_is_compared_with_each_reference_but_itself() -> None:
    runs = {"engine": [{"x": 1.0}], "gateway": [{"x": 4.0}], "router": [{"x": 2.0}]}
    got = comparisons(runs, ["engine", "router", "absent"])
    assert set(got) == {"gateway", "router", "engine"}
    assert got["gateway"]["engine"]["x"] == {"ratio": 4.0, "delta": 3.0}
    assert got["gateway"]["router"]["x"] == {"ratio": 2.0, "delta": 2.0}
    assert set(got["router"]) == {"engine"} and set(got["engine"]) == {"router"}
