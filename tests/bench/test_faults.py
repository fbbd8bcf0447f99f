"""The fault benchmark's accounting: gaps between successes, when the gateway declared an engine out and placed on
it again, what counts as lost and what as cut, and the median of the runs where an event came."""

from __future__ import annotations

import math

import pytest

from bench.benchmarks.faults import measures
from bench.harness.pairing import medians
from bench.workloads.engine_faults import (
    MAX_TOKENS,
    FaultRun,
    Outcome,
    Sample,
    admitted_at,
    figures,
    first_at,
    longest_gap,
    tokens_per_s,
)


@pytest.mark.parametrize(
    ("ends", "start", "stop", "gap"),
    [
        ([1.0, 2.0, 3.0], 0.0, 4.0, (1.0, 0.0)),  # even spacing: the first gap wins the tie
        ([1.0, 1.5, 6.0], 0.0, 7.0, (4.5, 1.5)),  # a stall between successes
        ([], 0.0, 5.0, (5.0, 0.0)),  # no success at all: the whole window
        ([0.5, 1.0], 0.0, 9.0, (8.0, 1.0)),  # serving stopped: the gap runs to the end
        ([-3.0, 1.0, 20.0], 0.0, 2.0, (1.0, 0.0)),  # successes outside the window do not count
    ],
)
def test_the_longest_gap_is_the_longest_time_without_a_success(
    ends: list[float], start: float, stop: float, gap: tuple[float, float]
) -> None:
    assert longest_gap(ends, start, stop) == gap


def sample(at: float, state: str, admitted: int, health: int = 200) -> Sample:
    return Sample(at, ("ready", state), (100, admitted), health)


SAMPLES = [sample(9.9, "ready", 40), sample(10.3, "down", 41), sample(12.0, "down", 41),
           sample(20.1, "down", 41), sample(24.0, "ready", 41), sample(25.0, "ready", 43, 503)]


def test_first_at_finds_the_first_sample_after_a_moment_that_holds() -> None:
    assert first_at(SAMPLES, 10.0, lambda s: s.states[1] == "down") == 10.3
    assert first_at(SAMPLES, 20.0, lambda s: s.states[1] == "ready") == 24.0
    assert first_at(SAMPLES, 0.0, lambda s: s.states[1] == "hung") is None


def test_admitted_at_reads_the_last_sample_at_or_before_a_moment() -> None:
    assert [admitted_at(SAMPLES, 1, t) for t in (0.0, 9.9, 11.0, 30.0)] == [0, 40, 41, 43]


def test_tokens_per_s_counts_successes_ended_in_the_window() -> None:
    outcomes = [Outcome(0.0, t, False, "0", result) for t, result in [(1.0, "ok"), (1.5, "lost"), (2.5, "ok")]]
    assert tokens_per_s(outcomes, 0.0, 2.0) == MAX_TOKENS / 2.0
    assert math.isnan(tokens_per_s(outcomes, 2.0, 2.0))


def test_a_runs_figures_split_losses_from_cut_streams_and_time_each_event_from_its_cause() -> None:
    outcomes = [
        Outcome(1.0, 2.0, False, "0", "ok"), Outcome(9.0, 10.2, True, "1", "cut", "APIError: engine gone"),
        Outcome(9.5, 11.0, False, "0", "ok"), Outcome(10.5, 11.5, True, "1", "ok"),  # answered while down
        Outcome(11.0, 12.0, False, None, "lost", "APIStatusError: 503"), Outcome(22.0, 25.5, False, "1", "ok"),
    ]
    run = FaultRun(outcomes, SAMPLES, loaded=0.0, fault=10.0, healed=20.0, ended=26.0, failovers=2.0)

    got = figures(run, "killed")

    assert (got["sent"], got["ok"], got["lost"], got["cut"], got["short"], got["failovers"]) == (6, 4, 1, 1, 0, 2.0)
    assert got["declared"] == pytest.approx(0.3)  # the first sample showing it down came 0.3 s after the kill
    assert got["placed_out"] == 0  # admissions while down: 41 when declared, 41 at the restart
    assert got["answered_out"] == 1
    assert got["rejoin_ready"] == pytest.approx(4.0)
    assert got["rejoin_placed"] == pytest.approx(5.0)  # admissions rose past 41 in the sample at 25.0
    assert got["gap"] == pytest.approx(14.0)  # from the success at 11.5 to the one at 25.5
    assert got["health_not_200"] == 1


def test_an_event_that_never_came_is_nan_and_left_out_of_the_median() -> None:
    never = FaultRun([], [sample(1.0, "ready", 5)], loaded=0.0, fault=0.5, healed=2.0, ended=3.0, failovers=0.0)
    got = figures(never, "frozen")
    assert math.isnan(got["declared"]) and math.isnan(got["placed_out"]) and math.isnan(got["rejoin_placed"])

    assert medians({"gateway": [{"declared": 5.5}, got, {"declared": 6.5}]})["gateway"]["declared"] == 6.0


@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_every_figure_of_a_run_is_a_measure_of_the_table(fault: str) -> None:
    never = FaultRun([], [sample(1.0, "ready", 5)], loaded=0.0, fault=0.5, healed=2.0, ended=3.0, failovers=0.0)
    assert {m.key for m in measures(fault)} == set(figures(never, fault))
