"""The preemption budget: the default policy books at a quantile that backs off towards the worst case when the
engine preempts past --preemption-budget per 100 completed requests, and comes back when it stops."""

from __future__ import annotations

import random

import pytest

from gateway.admission.budget import (
    BEST_QUANTILE,
    MAX_REACH,
    MIN_COMPLETIONS,
    REACH_PER_SECOND,
    WINDOW_SECONDS,
    PreemptionBudget,
)


def completed(budget: PreemptionBudget, count: int, at: float) -> None:
    for _ in range(count):
        budget.completed(at)


def test_preemptions_past_the_budget_halve_the_level_once_a_second_down_to_the_worst_case() -> None:
    control = PreemptionBudget(1.0)
    assert control.observe(0.0, None, at=0.0) == 0 and control.quantile == BEST_QUANTILE
    assert control.observe(2.0, 0.25, at=0.25) == 2.0 and control.value == 0.5
    control.observe(3.0, 0.25, at=0.5)  # the same burst: within a second of the last back-off
    assert control.value == 0.5
    for second, total in enumerate((4.0, 5.0, 6.0, 7.0), start=1):
        control.observe(total, 1.0, at=0.25 + second)
    assert control.value == 0.0 and control.quantile == 1.0  # 1/32 is below the floor


def test_preemptions_within_the_budget_hold_the_level() -> None:
    control = PreemptionBudget(2.0)
    completed(control, 200, 0.0)  # 200 completions: 4 preemptions allowed
    for second in range(4):
        control.observe(float(second), 1.0, at=1.0 + second)
    assert control.value == 1.0 and control.rate(4.0) == pytest.approx(1.5)
    control.observe(5.0, 1.0, at=6.0)
    assert control.value == 0.5  # 5 per 200: past 2 per 100


def test_the_rate_counts_at_least_twenty_completions_and_forgets_after_the_window() -> None:
    control = PreemptionBudget(5.0)
    control.observe(0.0, None, at=0.0)
    control.observe(1.0, 1.0, at=1.0)
    assert control.rate(1.0) == pytest.approx(100 / MIN_COMPLETIONS) and control.value == 1.0
    assert control.rate(1.0 + WINDOW_SECONDS + 0.1) == 0.0


def test_the_level_recovers_without_preemptions_only_while_nothing_waits_in_the_engine() -> None:
    control = PreemptionBudget(0.0)
    control.observe(0.0, None, at=0.0)
    control.observe(1.0, 0.25, at=0.25)
    assert control.value == 0.5
    control.observe(1.0, 1.0, at=1.25, engine_waiting=True)
    assert control.value == 0.5
    control.observe(1.0, 1.0, at=2.25)
    assert control.value == pytest.approx(0.55)
    control.observe(1.0, 600.0, at=602.25)  # a long gap (an outage) counts as two seconds at most
    assert control.value == pytest.approx(0.65)
    control.observe(1.0, None, at=603.0)  # no previous good snapshot: no clean time
    assert control.value == pytest.approx(0.65)


def test_preemptions_of_traffic_that_bypasses_the_gateway_are_not_held_against_it() -> None:
    control = PreemptionBudget(0.0)
    control.observe(0.0, None, at=0.0)
    assert control.observe(50.0, 1.0, at=1.0, blame=False) == 50.0
    assert control.value == 1.0 and control.rate(1.0) == 0.0


@pytest.mark.parametrize(
    ("room", "waiting", "reach"),
    [
        (True, False, 4 * REACH_PER_SECOND),  # room the projection does not see: four clean seconds of reach
        (False, False, 0.0),  # the engine's own usage near the budget: no room to reach for
        (True, True, 0.0),  # requests wait inside the engine: nothing more is sent past the model
    ],
)
def test_the_reach_past_the_budget_grows_only_while_the_engine_has_room_and_nothing_waits(
    room: bool, waiting: bool, reach: float
) -> None:
    control = PreemptionBudget(1.0)
    control.observe(0.0, None, at=0.0)
    for second in range(1, 5):
        control.observe(0.0, 1.0, at=float(second), engine_room=room, engine_waiting=waiting)
    assert control.reach == pytest.approx(reach) and control.quantile == BEST_QUANTILE


def full_reach(control: PreemptionBudget) -> None:
    control.observe(0.0, None, at=0.0)
    for second in range(1, 60):
        control.observe(0.0, 2.0, at=2.0 * second, engine_room=True)


def test_the_reach_stops_at_its_most_and_preemptions_past_the_budget_take_it_away_then_halve_the_level() -> None:
    control = PreemptionBudget(1.0)
    full_reach(control)
    assert control.reach == MAX_REACH and control.status(118.0)["reach"] == MAX_REACH
    control.observe(3.0, 2.0, at=120.0, engine_room=True)  # 3 preemptions over 20 completions: past 1 per 100
    assert control.value == 1.0 and control.reach == 0.0 and control.quantile == BEST_QUANTILE
    control.observe(6.0, 2.0, at=122.0, engine_room=True)
    assert control.value == 0.5 and control.quantile > BEST_QUANTILE  # more of them: the level halves


def test_the_reach_comes_back_only_once_the_preemptions_past_the_budget_have_aged_out() -> None:
    control = PreemptionBudget(1.0)
    full_reach(control)
    control.observe(3.0, 2.0, at=120.0, engine_room=True)
    control.observe(3.0, 1.0, at=121.0, engine_room=True)
    assert control.reach == 0.0  # room, but the window's preemptions are past the budget
    control.observe(3.0, 2.0, at=120.0 + WINDOW_SECONDS + 1.0, engine_room=True)
    assert control.reach == pytest.approx(2 * REACH_PER_SECOND)


@pytest.mark.parametrize("seed", range(20))
def test_the_level_stays_between_the_worst_case_and_full_reach_and_never_falls_without_preemptions(seed: int) -> None:
    rng = random.Random(seed)
    control = PreemptionBudget(rng.choice([0.0, 1.0, 5.0]))
    total, at = 0.0, 0.0
    control.observe(total, None, at=at)  # the counter's first reading: what later ones are an increase over
    for _ in range(300):
        at += rng.uniform(0.05, 2.0)
        completed(control, rng.randint(0, 10), at)
        preempted = rng.random() < 0.2
        total += rng.randint(1, 4) if preempted else 0
        before = control.value
        control.observe(total, rng.choice([None, 0.25, 1.0]), at=at, engine_waiting=rng.random() < 0.3,
                        blame=rng.random() < 0.9, engine_room=rng.random() < 0.5)
        assert 0.0 <= control.value <= 1.0 + MAX_REACH
        assert BEST_QUANTILE <= control.quantile <= 1.0
        assert preempted or control.value >= before
        assert not preempted or control.value <= before
