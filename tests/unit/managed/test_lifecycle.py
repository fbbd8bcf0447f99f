"""The lifecycle's states are the ones the metrics know, and Retry-After follows the state and its age."""

from __future__ import annotations

import pytest

from gateway.managed.lifecycle import DOWN_RETRY_AFTER, EngineLifecycle, Phase
from gateway.metrics import UPSTREAM_STATES, Metrics


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_states_are_the_metrics_states_and_compare_as_strings() -> None:
    assert tuple(EngineLifecycle) == UPSTREAM_STATES
    assert EngineLifecycle.READY == "ready"
    assert f"upstream_{EngineLifecycle.DOWN}" == "upstream_down"
    assert EngineLifecycle.STARTING in ("starting", "down")


def test_a_phase_starts_starting_and_tells_the_metrics_and_waiters() -> None:
    metrics = Metrics()
    phase = Phase(metrics, Clock())
    assert phase.state is EngineLifecycle.STARTING
    assert phase.unready.is_set()
    phase.set(EngineLifecycle.READY)
    assert not phase.unready.is_set()
    assert metrics.registry.get_sample_value("vllm_guard_upstream_up") == 1.0
    assert metrics.registry.get_sample_value("vllm_guard_upstream_state", {"state": "ready"}) == 1.0
    phase.set(EngineLifecycle.DRAINING)
    assert phase.unready.is_set()
    assert metrics.registry.get_sample_value("vllm_guard_upstream_up") == 0.0


@pytest.mark.parametrize(
    ("state", "elapsed", "expected"),
    [
        (EngineLifecycle.STARTING, 5.0, 25.0),  # 30 s expected, 5 s gone
        (EngineLifecycle.RESTARTING, 40.0, 1.0),  # overdue: never less than a second
        (EngineLifecycle.DRAINING, 1.0, 31.0),  # the drain left (2 - 1) plus a start-up
        (EngineLifecycle.DOWN, 1.0, DOWN_RETRY_AFTER),
        (EngineLifecycle.READY, 1.0, 1.0),
    ],
)
def test_retry_after_counts_down_from_the_state_change(state: EngineLifecycle, elapsed: float, expected: float) -> None:
    clock = Clock()
    phase = Phase(Metrics(), clock)
    phase.set(state)
    clock.now += elapsed
    assert phase.retry_after(30.0, drain_timeout=2.0) == expected


def test_every_start_up_attempt_restarts_the_clock_but_other_repeats_do_not() -> None:
    clock = Clock()
    phase = Phase(Metrics(), clock)
    clock.now += 10
    phase.set(EngineLifecycle.STARTING)
    assert phase.since == clock.now
    phase.set(EngineLifecycle.DOWN)
    clock.now += 10
    phase.set(EngineLifecycle.DOWN)
    assert phase.since == clock.now - 10
