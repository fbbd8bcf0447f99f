"""The scaling benchmark's arithmetic: a worker's cost, the authority's coordination beyond its own serving, and
the bound of M processes that they set (Amdahl's law, the coordination the serial part)."""

from __future__ import annotations

import math

import pytest

from bench.workloads import wrk
from bench.workloads.scaling import (
    Process,
    beyond_idle,
    bound_apart,
    bound_per_s,
    limit,
    served_by,
    speedup,
    split,
)


def test_the_authority_s_cpu_beyond_its_own_serving_is_its_coordination_per_request_a_worker_served() -> None:
    # One process costs 600 us a chat; the worker 700 (it also talks to the authority); the authority served
    # 1,000 chats (0.6 s at one process's price) and spent 0.8 s: 0.2 s for the worker's 2,000 chats.
    procs = [Process("authority", 0.8, 1000), Process("worker 1", 0.7, 1000), Process("worker 2", 0.7, 1000)]
    found = split(procs, one_us=600)
    assert found.units == 3000 and found.authority_share == pytest.approx(1 / 3)
    assert found.worker_us == pytest.approx(700)
    assert found.coordination_us == pytest.approx(100)  # 0.2 s / 2,000 chats
    assert found.coordination_whole_us == pytest.approx(200 / 3)
    assert found.authority_us == pytest.approx(800 / 3)
    assert found.coordination_of_worker == pytest.approx(1 / 7)


def test_without_one_process_s_price_the_authority_s_own_serving_is_priced_as_a_worker_s() -> None:
    procs = [Process("authority", 0.8, 1000), Process("worker 1", 0.7, 1000)]
    assert split(procs).coordination_us == pytest.approx(100)
    assert split(procs, one_us=math.nan).coordination_us == pytest.approx(100)


def test_a_run_with_nothing_served_gives_no_figures_rather_than_a_division_by_zero() -> None:
    found = split([Process("authority", 0.1, 0), Process("worker 1", 0.1, 0)])
    assert math.isnan(found.worker_us) and math.isnan(found.coordination_us)


def test_the_bound_is_the_authority_s_core_full_its_share_served_and_the_rest_coordinated() -> None:
    # w1 600, w 700, c 100: the authority's core at 8 processes is full at 8 / (600 + 7 x 100) us.
    assert bound_per_s(1, 600, 700, 100) == pytest.approx(1e6 / 600)
    assert bound_per_s(8, 600, 700, 100) == pytest.approx(8e6 / 1300)
    assert speedup(8, 600, 700, 100) == pytest.approx(8 * 600 / 1300)
    assert limit(600, 100) == pytest.approx(6.0)  # no number of workers passes one process's cost over c
    assert speedup(10_000, 600, 700, 100) < limit(600, 100)
    # With no coordination the workers' own cores bind: M / w.
    assert bound_per_s(8, 600, 700, 0) == pytest.approx(8e6 / 700)
    assert limit(600, 0) == math.inf


def test_an_authority_apart_is_bound_by_the_cores_all_processes_share_or_by_its_coordination() -> None:
    assert bound_apart(8, 700, 100) == pytest.approx(1e6 / 100)  # 8 / 800 us > 1 / 100 us: the authority's core
    assert bound_apart(2, 700, 100) == pytest.approx(2e6 / 800)
    # Two processes: the same bound as a serving authority; from three on, more (any c < w).
    assert bound_apart(2, 700, 100) == pytest.approx(bound_per_s(2, 700, 700, 100))
    for m in (3, 4, 8, 16):
        assert bound_apart(m, 700, 100) > bound_per_s(m, 700, 700, 100)


def test_units_are_assigned_to_processes_by_their_request_id_prefix() -> None:
    got = served_by({"authority": "aaaa", "worker 1": "bbbb", "worker 2": "?"}, {"aaaa": 5, "bbbb": 7, "-": 2})
    assert got == {"authority": 5.0, "worker 1": 7.0, "worker 2": 0.0}


def test_wrk_s_counts_by_header_prefix_are_summed_over_its_threads() -> None:
    out = ('{"requests": 12, "seconds": 1.0, "p50_ms": 1.0, "p99_ms": 2.0, "errors": 0}\n'
           "count aaaa 5\ncount bbbb 3\ncount aaaa 4\n")
    run = wrk.parse(out, cpu_s=0.1)
    assert run.requests == 12 and run.counts == {"aaaa": 9, "bbbb": 3}
    assert wrk.parse(out.splitlines()[0], cpu_s=0.0).counts == {}


def test_what_the_authority_spends_with_nothing_sent_is_taken_off_its_coordination() -> None:
    # Apart, over a 10 s load: 0.3 s of CPU, 0.1 s of it what it spends idle (10 ms a second); the workers served
    # 2,000 chats at 500 us each. c / w is 150 / 500 = 0.3; less the idle work 100 / 500 = 0.2.
    assert beyond_idle(0.3, 0.010, 10.0, 2000, 500) == pytest.approx(0.2)


@pytest.mark.parametrize(("idle", "served", "w"), [(math.nan, 2000, 500.0), (0.01, 0, 500.0), (0.01, 2000, math.nan)])
def test_without_an_idle_figure_or_units_there_is_no_figure(idle: float, served: float, w: float) -> None:
    assert math.isnan(beyond_idle(0.3, idle, 10.0, served, w))
