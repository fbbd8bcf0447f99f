"""Deadlines: a request waits in the queue no longer than its own deadline (the client's, or the TTFT objective)
less the engine's own time to a first token; one that cannot make it is refused at once with 503 deadline."""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import errors
from gateway.admission import Reservation
from gateway.admission.deadlines import (
    MIN_SAMPLES,
    QUANTILE,
    UNQUEUED_SAMPLES,
    WINDOW_SECONDS,
    Deadlines,
    FirstTokens,
)
from gateway.http.errors import error_headers, status_and_type
from tests.unit.admission.rig import BS, Rig, enter, settle
from tests.unit.admission.test_forecast_shed import finish, steady


def deadlined(rig: Rig, blocks: int, deadline: float | None, objective: float | None = None) -> Reservation:
    return rig.adm.reservation(prompt_tokens=8, max_tokens=blocks * BS - 8, n=1, priority=0, request_id="d",
                               deadline=deadline, objective=objective)


async def streamed_first_tokens(rig: Rig, seconds: float, count: int = MIN_SAMPLES) -> list[Reservation]:
    """``count`` requests in flight, each streaming its first token ``seconds`` after admission."""
    running = [await rig.req(1).__aenter__() for _ in range(count)]
    rig.clock.now += seconds
    for r in running:
        r.observe_output_tokens(0)  # the role-only first chunk: no token yet
        r.observe_output_tokens(1)
    return running


def test_the_engine_time_to_a_first_token_is_a_high_quantile_of_the_window() -> None:
    now = [0.0]
    tokens = FirstTokens(lambda: now[0])
    for s in (0.1, 0.2, 0.3):
        tokens.add(s)
    assert tokens.estimate() is None  # too few
    for s in (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 5.0):
        tokens.add(s)
    assert tokens.estimate() == 0.9
    now[0] = WINDOW_SECONDS + 1
    assert tokens.estimate() is None


@pytest.mark.parametrize(
    ("client", "objective", "in_flight", "seconds", "own", "queued"),
    [
        (None, None, 3, 30.0, False, (30.0, False)),  # the queue timeout
        (60.0, None, 3, 30.0, False, (30.0, False)),  # a client more patient than the queue
        (10.0, None, 3, 8.0, True, (8.0, True)),  # 10 s less the engine's 2 s
        (10.0, None, 0, 10.0, True, (10.0, True)),  # an idle engine: its figure is not today's
        (None, 5.0, 3, 3.0, True, (30.0, False)),  # the objective judges arrivals; once queued, the queue timeout
        (20.0, 5.0, 3, 3.0, True, (18.0, True)),  # ... or the client's own deadline
        (4.0, 5.0, 3, 2.0, True, (2.0, True)),  # the client's deadline, the nearer, holds throughout
        (1.5, None, 3, -0.5, True, (-0.5, True)),  # the engine alone is too slow
    ],
)
def test_the_wait_limit_is_the_earliest_deadline_less_the_engine_time(
    client: float | None, objective: float | None, in_flight: int, seconds: float, own: bool,
    queued: tuple[float, bool],
) -> None:
    deadlines = Deadlines(30.0, objective, lambda: 0.0)
    for _ in range(MIN_SAMPLES):
        deadlines.first_tokens.add(2.0)

    class Asked:
        deadline = client
        objective = None

    limit = deadlines.limit(Asked(), in_flight)
    assert (limit.seconds, limit.own) == (pytest.approx(seconds), own)
    assert (limit.queued.seconds, limit.queued.own) == (pytest.approx(queued[0]), queued[1])


async def test_a_request_queued_past_its_own_deadline_gets_503_deadline() -> None:
    rig = Rig(queue_timeout=30.0, shed_early="off")
    holder = await rig.req(10).__aenter__()
    waiting = deadlined(rig, 5, 2.0)
    task = enter(waiting)
    await settle()
    assert rig.adm.queued == 1
    rig.clock.now += 2.0
    rig.adm.tick()
    with pytest.raises(errors.DeadlineUnreachable) as caught:
        await task
    assert status_and_type(caught.value) == (503, "server_error") and caught.value.code == "deadline"
    assert "retry-after" in error_headers(caught.value)
    holder.release()
    rig.assert_drained()


async def test_a_request_whose_deadline_the_engine_alone_cannot_meet_is_refused_as_it_arrives() -> None:
    rig = Rig(queue_timeout=30.0)
    running = await streamed_first_tokens(rig, 3.0)
    with pytest.raises(errors.DeadlineUnreachable, match=r"takes 3\.0 s to a first token") as caught:
        await deadlined(rig, 1, 2.0).__aenter__()
    assert caught.value.reason == "deadline" and caught.value.retry_after is not None
    assert rig.adm.queued == 0
    async with deadlined(rig, 1, 5.0) as r:  # 5 s leaves it 2 s: admitted at once
        assert r.admitted
    for r in running:
        r.release()
    rig.assert_drained()


async def test_a_whole_answer_is_no_first_token_sample() -> None:
    rig = Rig()
    for _ in range(MIN_SAMPLES):
        r = await rig.req(1).__aenter__()
        rig.clock.now += 3.0
        r.observe_output_tokens(40)
        r.release()
    assert rig.adm.status()["deadlines"]["engine_first_token_s"] is None


async def test_the_forecast_refuses_at_once_a_request_that_would_miss_its_own_deadline() -> None:
    rig = Rig(queue_timeout=30.0)
    running, _, task = await steady(rig, 36)
    # 5 blocks wait ahead of its 10 at 5 blocks/s: 3 s, past its 2 s (the queue's 30 s would have let it wait).
    with pytest.raises(errors.DeadlineUnreachable, match=r"exceeds 80% of the 2\.0 s to the request's deadline") as c:
        await deadlined(rig, 10, 2.0).__aenter__()
    assert c.value.retry_after == pytest.approx(3.0)
    patient = enter(deadlined(rig, 10, 20.0))
    await settle()
    assert not patient.done() and rig.adm.queued == 2
    patient.cancel()
    await asyncio.gather(patient, return_exceptions=True)
    await finish(rig, running, task)


async def test_a_request_the_objective_queued_is_refused_as_soon_as_its_wait_and_the_engines_time_pass_it() -> None:
    """The objective judges a request as it arrives, and again once queued on what is known: its wait so far and
    the engine's time to a first token now (here 0.5 s). Past the objective it is refused at once (503 deadline,
    Retry-After) rather than served late (one that the llm-d router's objective alone judged waits on: below)."""
    rig = Rig(queue_timeout=30.0, ttft_objective=2.0, shed_early="off")
    running = await streamed_first_tokens(rig, 0.5)  # 1 block each
    holder = await rig.req(6).__aenter__()  # the cache is full
    waiting = enter(rig.req(5))
    await settle()
    assert rig.adm.queued == 1
    rig.clock.now += 1.4  # 1.4 + 0.5 s: within the objective
    rig.adm.tick()
    await settle()
    assert not waiting.done() and rig.adm.queued == 1
    rig.clock.now += 0.2  # 1.6 + 0.5 s: past it
    rig.adm.tick()
    with pytest.raises(errors.DeadlineUnreachable, match=r"Waited 1\.6 s .* TTFT objective of 2\.0 s") as caught:
        await waiting
    assert status_and_type(caught.value) == (503, "server_error") and caught.value.code == "deadline"
    assert "retry-after" in error_headers(caught.value)
    assert rig.adm.queued == 0
    holder.release()
    for r in running:
        r.release()
    rig.assert_drained()


async def test_the_ttft_objective_sheds_only_what_would_miss_it() -> None:
    rig = Rig(queue_timeout=30.0, ttft_objective=2.0)
    running, _, task = await steady(rig, 36)  # each waited 1 s, within the objective
    with pytest.raises(errors.DeadlineUnreachable):
        await rig.req(10).__aenter__()
    soon = enter(rig.req(1))  # 6 blocks to free: 1.2 s
    await settle()
    assert not soon.done()
    soon.cancel()
    await asyncio.gather(soon, return_exceptions=True)
    await finish(rig, running, task)


# -- the request's own objective (the llm-d router's x-llm-d-slo-ttft-ms) ---------------------------------------------
@pytest.mark.parametrize(
    ("client", "mine", "operator", "seconds", "queued"),
    [
        (None, 5.0, None, 3.0, (30.0, False)),  # its objective judges its arrival; once queued, the queue timeout
        (20.0, 5.0, None, 3.0, (18.0, True)),  # ... or the client's own deadline
        (4.0, 5.0, None, 2.0, (2.0, True)),  # the client's deadline, the nearer, holds throughout
        (None, 5.0, 3.0, 1.0, (30.0, False)),  # the earlier of its objective and the operator's
        (None, 3.0, 5.0, 1.0, (30.0, False)),
        (None, 1.5, None, -0.5, (30.0, False)),  # the engine alone is too slow: refused as it arrives
        (None, 60.0, None, 30.0, (30.0, False)),  # an objective past the queue timeout changes nothing
    ],
)
def test_the_requests_own_objective_judges_its_arrival_as_the_operators_does(
    client: float | None, mine: float, operator: float | None, seconds: float, queued: tuple[float, bool]
) -> None:
    deadlines = Deadlines(30.0, operator, lambda: 0.0)
    for _ in range(MIN_SAMPLES):
        deadlines.first_tokens.add(2.0)

    class Asked:
        deadline = client
        objective = mine

    limit = deadlines.limit(Asked(), 3)
    assert limit.seconds == pytest.approx(seconds)
    assert (limit.queued.seconds, limit.queued.own) == (pytest.approx(queued[0]), queued[1])


async def test_a_request_whose_own_objective_the_forecast_says_it_will_miss_is_refused_as_it_arrives() -> None:
    rig = Rig(queue_timeout=30.0, ttft_objective="off")
    running, _, task = await steady(rig, 36)
    # 5 blocks wait ahead of its 10 at 5 blocks/s: 3 s, past its own 2-s objective.
    with pytest.raises(errors.DeadlineUnreachable, match=r"exceeds 80% of the 2\.0 s") as caught:
        await deadlined(rig, 10, None, objective=2.0).__aenter__()
    assert caught.value.reason == "deadline" and caught.value.retry_after == pytest.approx(3.0)
    assert status_and_type(caught.value) == (503, "server_error") and "retry-after" in error_headers(caught.value)
    # The same request without an objective, or with one it can make, is queued.
    for patient in (enter(deadlined(rig, 10, None)), enter(deadlined(rig, 10, None, objective=20.0))):
        await settle()
        assert not patient.done()
        patient.cancel()
        await asyncio.gather(patient, return_exceptions=True)
    await finish(rig, running, task)


async def test_a_request_its_own_objective_queued_waits_past_it_within_its_clients_deadline() -> None:
    rig = Rig(queue_timeout=30.0, ttft_objective="off", shed_early="off")
    holder = await rig.req(10).__aenter__()
    served = enter(deadlined(rig, 5, None, objective=2.0))
    bounded = enter(deadlined(rig, 5, 8.0, objective=2.0))
    await settle()
    rig.clock.now += 5.0  # past both objectives
    rig.adm.tick()
    await settle()
    assert not served.done() and not bounded.done() and rig.adm.queued == 2
    rig.clock.now += 3.0  # the client's own deadline still ends a wait
    rig.adm.tick()
    with pytest.raises(errors.DeadlineUnreachable):
        await bounded
    holder.release()
    (await served).release()
    rig.assert_drained()


async def test_a_request_whose_own_objective_the_engine_alone_cannot_meet_is_refused_as_it_arrives() -> None:
    rig = Rig(queue_timeout=30.0, ttft_objective="off")
    running = await streamed_first_tokens(rig, 3.0)
    with pytest.raises(errors.DeadlineUnreachable, match=r"takes 3\.0 s to a first token") as caught:
        await deadlined(rig, 1, None, objective=2.0).__aenter__()
    assert caught.value.retry_after is not None and rig.adm.queued == 0
    async with deadlined(rig, 1, None) as r:  # without one: admitted at once
        assert r.admitted
    async with deadlined(rig, 1, None, objective=5.0) as r:  # 5 s leaves it 2 s
        assert r.admitted
    for r in running:
        r.release()
    rig.assert_drained()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 4), st.floats(-1, 30, allow_nan=False)), max_size=60))
def test_the_estimate_is_the_quantile_of_the_samples_in_the_window_whatever_comes_and_goes(
    steps: list[tuple[float, float]],
) -> None:
    now = [0.0]
    tokens = FirstTokens(lambda: now[0])
    added: list[tuple[float, float]] = []
    for gap, seconds in steps:
        now[0] += gap
        tokens.add(seconds)
        added.append((now[0], max(0.0, seconds)))
        window = sorted(s for t, s in added if t >= now[0] - WINDOW_SECONDS)
        at = min(len(window) - 1, math.ceil(QUANTILE * len(window)) - 1)
        expected = window[at] if len(window) >= MIN_SAMPLES else None
        assert tokens.estimate() == expected


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(-1, 30, allow_nan=False), st.booleans()), max_size=3 * UNQUEUED_SAMPLES))
def test_the_unhurried_estimate_is_the_quantile_of_the_last_unqueued_samples(steps: list[tuple[float, bool]]) -> None:
    tokens = FirstTokens(lambda: 0.0)
    unqueued: list[float] = []
    for seconds, queued in steps:
        tokens.add(seconds, queued=queued)
        if not queued:
            unqueued.append(max(0.0, seconds))
        last = sorted(unqueued[-UNQUEUED_SAMPLES:])
        expected = last[min(len(last) - 1, math.ceil(QUANTILE * len(last)) - 1)] if len(last) >= MIN_SAMPLES else None
        assert tokens.unqueued() == expected
