"""The watchdog turns observations stamped with made-up times into restart decisions."""

from __future__ import annotations

import pytest

from gateway.managed.watchdog import Watchdog, parse_progress


def dog(**kw: float) -> Watchdog:
    opts: dict[str, float] = {"hang_timeout": 10.0, "growth_mib": 1000.0, "storm": 50} | kw
    return Watchdog(0.0, hang_timeout=opts["hang_timeout"], growth_mib=opts["growth_mib"], storm=int(opts["storm"]))


@pytest.mark.parametrize(
    ("health", "reason"),
    [
        ([(1, True), (5, False), (10, False)], None),  # silent 5 s of 10
        ([(1, True), (5, False), (11, False)], "hang"),
        ([(5, False), (9, True), (15, False)], None),  # an answer in between resets the clock
    ],
)
def test_health_that_stays_silent_for_the_hang_timeout_is_a_hang(
    health: list[tuple[float, bool]], reason: str | None
) -> None:
    d = dog()
    results = [d.observe_health(t, ok) for t, ok in health]
    assert (results[-1].reason if results[-1] else None) == reason
    assert all(r is None for r in results[:-1])


@pytest.mark.parametrize(
    ("samples", "reason"),
    [
        ([(0, 2, 100), (5, 2, 100), (10, 2, 100)], "hang"),  # requests running, no token for 10 s
        ([(0, 2, 100), (5, 2, 150), (10, 2, 150)], None),  # progress at 5 s
        ([(0, 0, 100), (5, 0, 100), (12, 0, 100)], None),  # idle is not a hang
        ([(0, 0, 100), (5, 1, 100), (14, 1, 100)], None),  # running for only 9 s
        ([(0, None, None), (20, None, None)], None),  # metrics unknown: only /health decides
    ],
)
def test_running_requests_without_generated_tokens_are_a_hang(
    samples: list[tuple[float, float | None, float | None]], reason: str | None
) -> None:
    d = dog()
    results = [d.observe_engine(t, running, tokens, None) for t, running, tokens in samples]
    assert (results[-1].reason if results[-1] else None) == reason
    assert all(r is None for r in results[:-1])


@pytest.mark.parametrize(
    ("samples", "reason"),
    [
        ([(0, 0), (30, 20), (59, 50)], "preemption_storm"),
        ([(0, 0), (30, 30), (65, 60), (95, 70)], None),  # 60 in 65 s, but never 50 within a minute
        ([(0, 100), (10, 3), (20, 40)], None),  # a restarted engine counts from zero
    ],
)
def test_many_preemptions_within_a_minute_are_a_storm(samples: list[tuple[float, float]], reason: str | None) -> None:
    d = dog()
    results = [d.observe_engine(t, 1, t, p) for t, p in samples]
    assert (results[-1].reason if results[-1] else None) == reason


@pytest.mark.parametrize(
    ("readings", "growth", "reason"),
    [
        ([20000, 20500, 21000], 1000, "memory_growth"),
        ([20000, 20500, 20999], 1000, None),
        ([None, 20000, 30000], 0, None),  # 0 turns the check off
        ([None, None], 1000, None),
    ],
)
def test_gpu_memory_growing_past_its_baseline_is_fragmentation(
    readings: list[float | None], growth: float, reason: str | None
) -> None:
    d = dog(growth_mib=growth)
    results = [d.observe_memory(mib) for mib in readings]
    assert (results[-1].reason if results[-1] else None) == reason


def test_progress_is_summed_over_engines_from_vllms_metrics() -> None:
    text = (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
        'vllm:generation_tokens_total{engine="0",model_name="m"} 1234.0\n'
        'vllm:num_preemptions_total{engine="0",model_name="m"} 7.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
    )
    assert parse_progress(text) == (3.0, 1234.0, 7.0)
    assert parse_progress("") == (None, None, None)


def test_answers_completing_through_the_gateway_are_progress_though_the_tokens_never_move() -> None:
    # An engine that answers at once: it shows requests running, but its generated-token counter never moves.
    d = dog()
    results = []
    for t in range(0, 60, 2):
        d.observe_answers(t, answers=t * 500)
        results.append(d.observe_engine(t, 2, 100, None))
    assert results == [None] * len(results)
    d.observe_answers(60, answers=30_000)  # then nothing completes any more
    assert d.observe_engine(70, 2, 100, None) is not None


@pytest.mark.parametrize(
    ("moving", "reason"),
    [
        (True, None),  # a busy API server: /health silent while answers still complete
        (False, "hang"),
    ],
)
def test_a_silent_health_is_a_hang_only_when_nothing_moves_either(moving: bool, reason: str | None) -> None:
    d = dog()
    assert d.observe_health(0, True) is None
    d.observe_answers(0, 0)
    result = None
    for t in range(1, 15):
        d.observe_answers(t, t if moving else 0)
        result = d.observe_health(t, False)
        if result is not None:
            break
    assert (result.reason if result else None) == reason
