"""The pace: the cap on requests in flight falls when the first tokens the engine gave the admitted come late
against the objective, grows back while they come well within it and requests wait behind it, and is no cap at all
without an objective."""

from __future__ import annotations

import asyncio

import pytest

from gateway import errors
from gateway.admission.pace import DECREASE, MIN_CAP, MIN_SAMPLES, STEP_SECONDS, WINDOW_SECONDS, Pace
from tests.unit.admission.rig import Rig, enter, five_running_after_slow_first_tokens, settle


def fed(engine: float, waited: float = 0.0, objective: float | None = 5.0, count: int = MIN_SAMPLES,
        now: float = 10.0) -> Pace:
    """A pace that saw ``count`` first tokens at ``now``, each ``engine`` seconds after an admission that came
    ``waited`` seconds after arrival."""
    pace = Pace()
    for _ in range(count):
        pace.first_token(now, waited, engine, objective)
    return pace


@pytest.mark.parametrize(
    ("engine", "waited", "judged", "cap"),
    [
        (1.0, 0.5, 5.0, None),  # well within: nothing to tighten, no cap to loosen
        (3.0, 0.0, 5.0, int(DECREASE * 40)),  # the engine alone takes more than half the objective
        (2.0, 3.5, 5.0, int(DECREASE * 40)),  # the wait and the engine's time pass the objective
        (2.0, 3.5, None, None),  # ... for requests no objective judged (queued before one applied): no evidence
    ],
)
def test_the_cap_falls_when_the_engine_or_the_admitted_first_tokens_come_late(
    engine: float, waited: float, judged: float | None, cap: int | None
) -> None:
    pace = fed(engine, waited, judged)
    pace.step(10.0, 5.0, in_flight=40, queued=True, engine_waiting=0)
    assert pace.cap == cap


def test_the_cap_falls_again_only_on_requests_admitted_under_it() -> None:
    pace = fed(3.0)
    pace.step(10.0, 5.0, in_flight=40, queued=True, engine_waiting=0)
    assert pace.cap == 32
    pace.step(10.0 + 2 * STEP_SECONDS, 5.0, in_flight=32, queued=True, engine_waiting=0)
    assert pace.cap == 32  # the same slow first tokens: admitted before the cap fell
    for _ in range(MIN_SAMPLES):
        pace.first_token(15.0, 0.0, 3.0, 5.0)  # admitted at 12 s, still slow
    pace.step(15.0, 5.0, in_flight=32, queued=True, engine_waiting=0)
    assert pace.cap == 25


def test_the_cap_never_falls_below_its_floor() -> None:
    pace = fed(4.0)
    pace.step(10.0, 5.0, in_flight=1, queued=True, engine_waiting=0)
    assert pace.cap == MIN_CAP


@pytest.mark.parametrize(
    ("queued", "in_flight", "engine_waiting", "engine", "grows"),
    [
        (True, 32, 0, 1.0, True),  # it binds, the engine is quick: one more request or 5% a step
        (False, 32, 0, 1.0, False),  # nothing waits behind it
        (True, 20, 0, 1.0, False),  # it does not bind
        (True, 32, 3, 1.0, False),  # requests wait inside the engine
        (True, 32, 0, 2.0, False),  # the engine's time is within half the objective but not well within
    ],
)
def test_the_cap_grows_back_only_while_it_binds_and_the_engine_is_quick(
    queued: bool, in_flight: int, engine_waiting: int, engine: float, grows: bool
) -> None:
    pace = fed(3.0)
    pace.step(10.0, 5.0, in_flight=40, queued=True, engine_waiting=0)
    assert pace.cap == 32
    for _ in range(MIN_SAMPLES):
        pace.first_token(14.0, 0.0, engine, 5.0)
    pace.step(14.0, 5.0, in_flight=in_flight, queued=queued, engine_waiting=engine_waiting)
    assert pace.cap == (33 if grows else 32)


def test_without_an_objective_there_is_no_cap_and_old_first_tokens_age_out() -> None:
    pace = fed(3.0)
    pace.step(10.0, 5.0, in_flight=40, queued=True, engine_waiting=0)
    assert pace.cap is not None and pace.binds(40)
    pace.step(11.0, None, in_flight=40, queued=True, engine_waiting=0)
    assert pace.cap is None and not pace.binds(1000)
    pace.step(10.0 + WINDOW_SECONDS + 10.0, 5.0, in_flight=40, queued=True, engine_waiting=0)
    assert pace.cap is None  # the slow first tokens are older than the window
    assert pace.status()["cap"] is None


@pytest.mark.parametrize(
    ("in_flight", "queued", "forgotten"),
    [
        (0, False, True),  # nothing run or asked for over a whole window: the cap was another load's
        (3, False, False),  # requests still run under it
        (0, True, False),  # requests wait for it
    ],
)
def test_a_cap_learned_in_an_overload_is_forgotten_once_a_whole_window_passed_idle(
    in_flight: int, queued: bool, forgotten: bool
) -> None:
    pace = fed(3.0)
    pace.step(10.0, 5.0, in_flight=40, queued=True, engine_waiting=0)
    assert pace.cap == 32
    pace.step(10.0 + WINDOW_SECONDS + 1.0, 5.0, in_flight=in_flight, queued=queued, engine_waiting=0)
    assert (pace.cap is None) == forgotten


async def test_the_admission_holds_the_requests_in_flight_to_the_cap_and_refuses_at_arrival_past_its_turn() -> None:
    """With the engine's first tokens slow against the objective, admission stops at the cap though KV blocks are
    free; an arrival whose turn at the rate requests end comes past 80% of its wait is refused at once."""
    rig = Rig(queue_timeout=30.0, ttft_objective=8.0, kv_blocks=100)
    # First tokens 4.5 s after admission (past half the objective); five end, at 5 a second.
    running = await five_running_after_slow_first_tokens(rig, 4.5)
    rig.adm._deadlines.steer(len(running), True, 0)  # an engine snapshot's step
    cap = rig.adm.status()["deadlines"]["pace_cap"]
    assert cap == 4  # 80% of the five in flight
    waiting = [enter(rig.req(1)) for _ in range(14)]
    await settle()
    assert rig.adm.in_flight == 5 and rig.adm.queued == 14  # blocks are free: the cap holds them
    # 8 s less the engine's 4.5 s leaves 3.5 s to wait, 80% of it 2.8 s: the 15th in line, at 5 a second, takes 3 s.
    with pytest.raises(errors.DeadlineUnreachable, match=r"requests the engine runs at once") as caught:
        await rig.req(1).__aenter__()
    assert caught.value.retry_after is not None and rig.adm.queued == 14
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    for r in running:
        r.release()
    rig.assert_drained()
