"""--ttft-objective auto, the default: a burst that arrives at once is queued whole and served however long the
engine takes; once a request that arrived into a backlog has waited longer than the derived wait (the overload is
sustained), an arriving request may wait only the engine's unhurried time to a first token (at least a second), and
one forecast to miss that is refused at once with 503 deadline; the queue emptying ends it. ``SECONDS`` holds for
every request at all times, ``off`` never derives one."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway import errors
from gateway.admission import Reservation, refusals
from gateway.admission.deadlines import MIN_SAMPLES, UNHURRIED_AHEAD, Deadlines, WaitLimit
from gateway.admission.sustained import CALM_SECONDS, MIN_WAIT_SECONDS, SustainedOverload
from gateway.config import Settings
from tests.unit.admission.rig import Rig, enter, five_running_after_slow_first_tokens, settle

DEFAULT_QUEUE_TIMEOUT = Settings().queue_timeout


@pytest.mark.parametrize(("unhurried", "wait", "objective"), [
    pytest.param(0.0, MIN_WAIT_SECONDS, 2.0, id="an engine with no figure yet: the floor"),
    pytest.param(0.4, MIN_WAIT_SECONDS, 2.0, id="a fast engine: at least a second of wait"),
    pytest.param(2.5, 2.5, 5.0, id="a slow engine: as long as its own unhurried time"),
])
def test_the_derived_wait_is_the_engines_unhurried_time_to_a_first_token_at_least_a_second(
    unhurried: float, wait: float, objective: float
) -> None:
    # The objective: the wait, and as long again in the engine (``Deadlines.compute_room`` holds it there).
    overload = SustainedOverload(enabled=True)
    assert (overload.wait(unhurried), overload.objective(unhurried)) == (pytest.approx(wait), pytest.approx(objective))


@pytest.mark.parametrize(("enabled", "waits", "empty_for", "sustained"), [
    pytest.param(True, [(0.5, True), (1.0, True)], None, False, id="waits within the wait: a queue that drains"),
    pytest.param(True, [(0.5, True), (1.2, True)], None, True, id="one arrived into a backlog and waited past it"),
    pytest.param(True, [(30.0, False)] * 3, None, False, id="a burst's own long waits: it arrived at once"),
    pytest.param(True, [(1.2, True)], 0.5, True, id="a queue empty for a moment between a release and an arrival"),
    pytest.param(True, [(1.2, True)], CALM_SECONDS, False, id="until the queue stays empty for a second"),
    pytest.param(False, [(60.0, True)], None, False, id="off or SECONDS: never derived"),
])
def test_an_overload_is_sustained_once_a_request_that_arrived_into_a_backlog_waited_past_the_wait(
    enabled: bool, waits: list[tuple[float, bool]], empty_for: float | None, sustained: bool
) -> None:
    overload = SustainedOverload(enabled)
    overload.queue(True, 0.0, unhurried=lambda: 0.0)
    for i, (waited, backlogged) in enumerate(waits):
        overload.left_queue(i, waited, unhurried=0.0, backlogged=backlogged)
    if empty_for is not None:
        overload.queue(False, 10.0, unhurried=lambda: 0.0)
    assert overload.applies(10.0 + (empty_for or 0.0)) is sustained


@pytest.mark.parametrize(("enabled", "arrived", "left", "now", "unhurried", "sustained"), [
    pytest.param(True, [0.0], [], 1.2, 0.0, True, id="still waiting past the wait: sustained before it leaves"),
    pytest.param(True, [0.0], [], 0.8, 0.0, False, id="still within the wait"),
    pytest.param(True, [0.0, 0.5], [0], 1.2, 0.0, False, id="the first left in time, the next within the wait"),
    pytest.param(True, [0.0, 0.5], [0], 1.6, 0.0, True, id="the next one waited past it"),
    pytest.param(True, [0.0], [], 1.8, 2.0, False, id="a slow engine's own longer wait"),
    pytest.param(False, [0.0], [], 60.0, 0.0, False, id="off or SECONDS: never derived"),
])
def test_an_overload_is_sustained_as_soon_as_a_request_that_arrived_into_a_backlog_has_waited_past_the_wait(
    enabled: bool, arrived: list[float], left: list[int], now: float, unhurried: float, sustained: bool
) -> None:
    # At twice the engine's capacity the first such request left the queue 12-13 s into a surge; meanwhile the
    # queue grew, every request in it to be served late.
    overload = SustainedOverload(enabled)
    for key, at in enumerate(arrived):
        overload.arrived_into_backlog(key, at)
    for key in left:
        overload.left_queue(key, 0.5, unhurried, backlogged=True)
    overload.queue(True, now, lambda: unhurried)
    assert overload.applies(now) is sustained


@pytest.mark.parametrize(("objective", "sustained", "client", "unhurried", "engine", "seconds", "own", "derived"), [
    pytest.param("auto", False, None, 0.1, 0.3, DEFAULT_QUEUE_TIMEOUT, False, False, id="auto, no overload: the queue"),
    pytest.param("auto", True, None, 0.1, 0.3, 1.0, True, True, id="auto, sustained: at least a second"),
    pytest.param("auto", True, None, 2.0, 2.0, 2.0, True, True, id="auto, sustained, slow engine: its own time"),
    pytest.param("auto", True, None, 0.1, 3.0, 1.0, True, True,
                 id="auto, sustained, an engine slowed by the load: its unhurried time still"),
    pytest.param("auto", True, 60.0, 0.1, 0.3, 1.0, True, True, id="a patient client: the derived wait"),
    pytest.param("auto", True, 1.0, 0.1, 0.3, 0.7, True, False, id="an impatient client: its own deadline"),
    pytest.param("off", True, None, 0.1, 0.3, DEFAULT_QUEUE_TIMEOUT, False, False, id="off: the queue timeout"),
    pytest.param(5.0, False, None, 0.1, 2.0, 3.0, True, False, id="SECONDS: always, less the engine's time"),
])
def test_the_wait_limit_under_each_objective(
    objective: float | str, sustained: bool, client: float | None, unhurried: float, engine: float, seconds: float,
    own: bool, derived: bool,
) -> None:
    deadlines = Deadlines(DEFAULT_QUEUE_TIMEOUT, objective, lambda: 0.0)
    for _ in range(MIN_SAMPLES):
        deadlines.first_tokens.add(unhurried)  # admitted as they arrived
        deadlines.first_tokens.add(engine, queued=True)  # the engine's time now: the window's 0.9 quantile
    deadlines.sustained.sustained = sustained

    class Asked:
        deadline = client
        objective = None

    limit = deadlines.limit(Asked(), in_flight=3)
    assert (limit.seconds, limit.own, limit.derived) == (pytest.approx(seconds), own, derived)


async def test_a_burst_that_arrives_at_once_is_served_whole_however_long_the_engine_takes() -> None:
    # The defaults (queue timeout and objective): twelve requests of 5 blocks where two fit, one ending every 10 s;
    # two stragglers of it arrive just after the first of the queued were admitted, having waited 10 s.
    rig = Rig(queue_timeout=DEFAULT_QUEUE_TIMEOUT, admission_policy="strict")
    tasks = [enter(rig.req(5)) for _ in range(10)]
    await settle()
    assert rig.adm.in_flight == 2 and rig.adm.queued == 8
    served = 0
    while served < 12:
        rig.clock.now += 10.0
        rig.adm.tick()
        if served == 1:
            tasks += [enter(rig.req(5)) for _ in range(2)]
            await settle()
        running = [t for t in tasks if t.done()]
        assert all(t.exception() is None for t in running), [t.exception() for t in running]  # none refused
        running[served].result().release()
        served += 1
        await settle()
    rig.clock.now += CALM_SECONDS
    assert rig.adm.status()["deadlines"]["sustained_overload"] is False  # the queue stayed empty a second
    rig.assert_drained()


async def sustained(rig: Rig, releases: int = 12) -> tuple[list[Reservation], asyncio.Task[Reservation]]:
    """Two requests of 5 blocks in flight on 10 and one waiting; 1.5 s later another arrives into that backlog
    (past the 1-s wait of an engine with no figure yet) and is admitted 1.5 s later (sustained); from then on one
    arrives and one is released every 0.5 s (10 blocks freed a second)."""
    running = [await rig.req(5).__aenter__(), await rig.req(5).__aenter__()]
    first = enter(rig.req(5))
    await settle()
    rig.clock.now += 1.5
    task = enter(rig.req(5))
    await settle()
    rig.clock.now += 1.0
    running.pop(0).release()
    running.append(await first)
    for _ in range(releases):
        rig.clock.now += 0.5
        running.pop(0).release()
        running.append(await task)
        task = enter(rig.req(5))
        await settle()
    return running, task


@pytest.mark.parametrize("objective", ["auto", "off"])
async def test_once_sustained_an_arrival_forecast_past_the_derived_wait_is_refused_at_once(objective: str) -> None:
    rig = Rig(queue_timeout=DEFAULT_QUEUE_TIMEOUT, admission_policy="strict", ttft_objective=objective)
    running, task = await sustained(rig)
    assert rig.adm.status()["deadlines"]["sustained_overload"] is (objective == "auto")
    # 5 blocks ahead and its own 10 at 10 blocks/s: 1.5 s, past 80% of the 1 s it may wait (not of the 300-s queue).
    arriving = enter(rig.req(10))
    await settle()
    if objective == "auto":
        with pytest.raises(errors.DeadlineUnreachable, match=r"exceeds 80% of the 1\.0 s a request may wait while "
                           r"the overload is sustained \(--ttft-objective auto\)") as caught:
            await arriving
        assert caught.value.code == "deadline" and caught.value.retry_after == pytest.approx(1.5)
        soon = enter(rig.req(1))  # 6 blocks to free: 0.6 s, within 80% of its second
        await settle()
        assert not soon.done() and rig.adm.queued == 2
        soon.cancel()
        await asyncio.gather(soon, return_exceptions=True)
    else:
        assert not arriving.done() and rig.adm.queued == 2  # off: the queue timeout only
        arriving.cancel()
        await asyncio.gather(arriving, return_exceptions=True)
    for r in running:
        r.release()
    (await task).release()
    await settle()
    rig.clock.now += CALM_SECONDS
    assert rig.adm.status()["deadlines"]["sustained_overload"] is False  # the queue stayed empty a second
    # The next load starts anew: its first arrivals are queued, not judged against the derived wait.
    running = [await rig.req(5).__aenter__(), await rig.req(5).__aenter__()]
    queued = enter(rig.req(5))
    await settle()
    assert not queued.done() and rig.adm.queued == 1
    running.pop(0).release()
    (await queued).release()
    running[0].release()
    rig.assert_drained()


@pytest.mark.parametrize(("objective", "sustained", "engine", "room"), [
    pytest.param(5.0, False, 2.4, True, id="SECONDS: the engine takes under half of it"),
    pytest.param(5.0, False, 2.6, False, id="SECONDS: over half of it"),
    pytest.param("auto", False, 9.0, True, id="auto, no overload: no objective to keep"),
    pytest.param("auto", True, 0.9, True, id="auto, sustained: within the second it allows"),
    pytest.param("auto", True, 1.5, False, id="auto, sustained: past it"),
    pytest.param("off", True, 9.0, True, id="off: no objective"),
])
def test_the_engine_has_room_for_more_while_its_first_tokens_leave_time_within_the_objective(
    objective: float | str, sustained: bool, engine: float, room: bool
) -> None:
    deadlines = Deadlines(DEFAULT_QUEUE_TIMEOUT, objective, lambda: 0.0)
    for _ in range(MIN_SAMPLES):
        deadlines.first_tokens.add(0.1)  # unhurried: admitted as they arrived
        deadlines.first_tokens.add(engine, queued=True)
    deadlines.sustained.sustained = sustained
    # The window's 0.9 quantile: the engine's time now; the floor of a second stands for its unhurried 0.1 s.
    assert deadlines.compute_room(in_flight=3) is room


@pytest.mark.parametrize(("feedback", "refused_at", "sustained"), [
    pytest.param(True, None, False, id="an empty queue and nobody refused for a second: over"),
    pytest.param(True, 0.6, True, id="an empty queue because arrivals are refused at once: still sustained"),
    pytest.param(False, 0.6, False, id="--sustained-feedback off: an empty queue for a second ends it"),
])
def test_with_feedback_an_overload_whose_arrivals_are_refused_into_an_empty_queue_stays_sustained(
    feedback: bool, refused_at: float | None, sustained: bool
) -> None:
    overload = SustainedOverload(enabled=True, refusals_count=feedback)
    overload.left_queue("r", 1.2, 0.0, backlogged=True)
    assert overload.applies(0.0)
    overload.queue(False, 0.0, lambda: 0.0)  # the queue empties
    if refused_at is not None:
        overload.refused(refused_at)
    assert overload.applies(CALM_SECONDS + 0.1) is sustained
    assert not overload.applies(CALM_SECONDS + 0.7)  # a second with neither


def test_with_feedback_first_tokens_while_the_overload_is_sustained_leave_the_unhurried_time_where_it_was() -> None:
    deadlines = Deadlines(DEFAULT_QUEUE_TIMEOUT, "auto", lambda: 0.0, feedback=True)
    for _ in range(MIN_SAMPLES):
        deadlines.first_token(0.2, waited=0.0, queued=False, limit=None)  # an engine that was not overloaded
    deadlines.sustained.left_queue("r", 1.2, 0.2, backlogged=True)
    assert deadlines.sustained.applies(0.0)
    for _ in range(64):
        deadlines.first_token(3.0, waited=0.0, queued=False, limit=None)  # admitted as they arrived into a full one
    assert deadlines.unhurried() == pytest.approx(0.2)
    assert deadlines.status()["engine_first_token_s"] == pytest.approx(3.0)  # the engine's time now still moves


@pytest.mark.parametrize("feedback", ["on", "off"])
async def test_with_feedback_a_request_queued_under_the_derived_wait_is_refused_once_past_the_derived_objective(
    feedback: str,
) -> None:
    rig = Rig(queue_timeout=DEFAULT_QUEUE_TIMEOUT, admission_policy="strict", sustained_feedback=feedback)
    running, task = await sustained(rig)
    rig.clock.now += 1.9  # nothing released: within twice the 1-s wait
    rig.adm.tick()
    await settle()
    assert not task.done()
    rig.clock.now += 0.2  # past it
    rig.adm.tick()
    if feedback == "off":  # the derived objective judges arrivals only: it waits on
        await settle()
        assert not task.done()
        running.pop(0).release()
        (await task).release()
        for r in running:
            r.release()
        rig.assert_drained()
        return
    with pytest.raises(errors.DeadlineUnreachable, match=r"past the TTFT objective of 2\.0 s while the overload is "
                       r"sustained \(--ttft-objective auto\)") as caught:
        await task
    assert caught.value.retry_after is not None and rig.adm.queued == 0
    for r in running:
        r.release()
    rig.assert_drained()


@pytest.mark.parametrize(("waiting", "unhurried"), [
    pytest.param(0, 2.0, id="admitted as they arrived into an engine with nothing waiting: its unhurried time"),
    pytest.param(3, None, id="admitted as they arrived into an engine's own queue: queued there, not unhurried"),
])
async def test_the_unhurried_time_counts_only_requests_that_waited_in_no_queue_the_engines_own_included(
    waiting: int, unhurried: float | None
) -> None:
    rig = Rig(engine=True, admission_policy="strict")
    await rig.scrape(0.0, running=2, waiting=waiting)
    for _ in range(MIN_SAMPLES):
        async with rig.req(1) as r:
            rig.adm.first_token(r, 2.0)
    assert rig.adm.status()["deadlines"]["engine_first_token_unqueued_s"] == unhurried
    rig.assert_drained()


@pytest.mark.parametrize(("ahead", "unhurried"), [
    pytest.param(UNHURRIED_AHEAD, 2.0, id="admitted behind a few of ours awaiting a first token: unhurried"),
    pytest.param(UNHURRIED_AHEAD + 1, None, id="behind a crowd of them, as a surge's first hundred: not unhurried"),
])
async def test_a_request_admitted_behind_a_crowd_of_ours_awaiting_their_first_token_is_no_sample_of_the_unhurried_time(
    ahead: int, unhurried: float | None
) -> None:
    rig = Rig(kv_blocks=100, admission_policy="strict")
    crowd = [await rig.req(1).__aenter__() for _ in range(ahead)]  # admitted, prefilling: no first token yet
    for _ in range(MIN_SAMPLES):
        async with rig.req(1) as r:
            rig.clock.now += 2.0
            r.observe_output_tokens(1)  # its first token, 2 s after it was sent
    assert rig.adm.status()["deadlines"]["engine_first_token_unqueued_s"] == unhurried
    for r in crowd:
        r.release()
    rig.assert_drained()


def unhurried_deadlines(sustained: bool) -> tuple[Deadlines, list[float]]:
    """Deadlines under ``auto`` on a clock the test moves, the engine's unhurried time short (the wait: a second)."""
    now = [0.0]
    deadlines = Deadlines(DEFAULT_QUEUE_TIMEOUT, "auto", lambda: now[0])
    for _ in range(MIN_SAMPLES):
        deadlines.first_tokens.add(0.1)
    deadlines.sustained.sustained = sustained
    return deadlines, now


def follow_engine(deadlines: Deadlines, now: list[float], seconds: float, waiting: int, *, queued_for: float = 0.0,
                  first_token: float = 1.5, in_flight: int = 16) -> None:
    """``seconds`` of engine snapshots 0.25 s apart showing ``waiting`` in vLLM's queue, four first tokens a second
    (each stream ending soon after); the gateway's own queue holds requests for the first ``queued_for`` seconds,
    then none."""
    for step in range(round(seconds / 0.25) + 1):
        now[0] = step * 0.25
        deadlines.queue(now[0] < queued_for, now[0])
        deadlines.first_token(first_token, waited=0.0, queued=True, limit=None)
        deadlines.left_engine(timed=True)
        deadlines.steer(in_flight=in_flight, queued=False, engine_waiting=waiting)


@pytest.mark.parametrize(("sustained", "waiting", "now_sustained", "told"), [
    pytest.param(False, 10, True, True, id="2.5 s a request in the engine's queue: sustained, and the operator told"),
    pytest.param(True, 10, True, True, id="already sustained in the gateway's queue: told all the same"),
    pytest.param(False, 2, False, False, id="half a second there, within the wait of a second: not an overload"),
    pytest.param(False, 0, False, False, id="nothing waits in the engine (its cache binds first): nothing changes"),
])
def test_an_overload_is_seen_in_the_engines_own_queue_once_its_mean_wait_passes_the_wait(
    sustained: bool, waiting: int, now_sustained: bool, told: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # With 1,024 blocks the engine's prefill binds before its cache: KV room admitted every arrival into vLLM's own
    # queue, the gateway's stayed empty, and the overload went unseen for ten seconds while first tokens climbed.
    deadlines, now = unhurried_deadlines(sustained)
    with caplog.at_level(logging.WARNING, logger="gateway.admission.deadlines"):
        follow_engine(deadlines, now, 10.0, waiting)  # the gateway's own queue empty throughout
    warnings = [r.getMessage() for r in caplog.records if "engine's own queue" in r.getMessage()]
    assert len(warnings) == (1 if told else 0)  # once an overload, not on every snapshot
    assert deadlines.status()["engine_queue_wait_s"] == pytest.approx(waiting / 4.0, rel=0.1)
    assert deadlines.sustained.applies(now[0]) is now_sustained


@pytest.mark.parametrize(("streaming", "wait", "now_sustained"), [
    pytest.param(0, 4.0, True, id="our 16 in flight all wait for a first token: 16 of the 40 are ours, 4 s"),
    pytest.param(14, 0.5, False, id="14 of our 16 stream: 2 of the 40 at most are ours, half a second"),
])
def test_a_queue_in_the_engine_of_requests_not_ours_is_not_read_as_our_wait(
    streaming: int, wait: float, now_sustained: bool
) -> None:
    # vLLM's queue held requests of clients that had sent them around the gateway (or left them behind): counted
    # over our departures, Little's law read 8.6 s where ours waited 0.01 s, and the overload was seen where none was.
    deadlines, now = unhurried_deadlines(sustained=False)
    for _ in range(streaming):
        deadlines.first_token(0.5, waited=0.0, queued=False, limit=None)
    follow_engine(deadlines, now, 10.0, 40, in_flight=16)
    assert deadlines.status()["engine_queue_wait_s"] == pytest.approx(wait, rel=0.1)
    assert deadlines.sustained.applies(now[0]) is now_sustained


@pytest.mark.parametrize(("ahead_waiting", "calm"), [
    pytest.param(0, True, id="vLLM's queue empty too: a second of an empty gateway queue ends it"),
    pytest.param(1, True, id="a quarter of the wait ahead there: ends it as well"),
    pytest.param(3, False, id="three quarters of the wait ahead there: vLLM's queue holds the overload, not calm"),
])
def test_a_sustained_overload_is_not_calm_while_the_engines_queue_holds_half_the_wait(
    ahead_waiting: int, calm: bool
) -> None:
    deadlines, now = unhurried_deadlines(sustained=True)
    follow_engine(deadlines, now, 10.0, ahead_waiting, queued_for=2.0, first_token=0.5)
    assert deadlines.sustained.applies(now[0]) is not calm


@pytest.mark.parametrize(("waiting", "seconds"), [
    pytest.param(0, 1.0, id="nothing waits in the engine: the whole wait in the gateway's queue"),
    pytest.param(2, 0.5, id="half a second ahead in the engine's queue: half a second left for the gateway's"),
    pytest.param(8, -1.0, id="two seconds ahead there, past the wait: no time left, refused as it arrives"),
])
def test_under_a_sustained_overload_the_wait_ahead_in_the_engines_queue_comes_off_the_derived_wait(
    waiting: int, seconds: float
) -> None:
    deadlines, now = unhurried_deadlines(sustained=True)
    follow_engine(deadlines, now, 5.0, waiting, queued_for=6.0, first_token=0.5)
    class Arriving:
        deadline = None
        objective = None

    limit = deadlines.limit(Arriving(), in_flight=8)
    assert limit.derived and limit.seconds == pytest.approx(seconds, abs=0.1)


@pytest.mark.parametrize("answer", [
    pytest.param([1, 5, 9], id="a stream: counted as its first token comes, not again as it ends"),
    pytest.param([], id="nothing generated (cut before its first token): counted as it ends"),
    pytest.param([40], id="a whole answer's usage at once, no first token timed: counted as it ends"),
])
async def test_every_admitted_request_leaves_the_engines_queue_once(answer: list[int]) -> None:
    # Little's law needs the rate requests leave vLLM's queue; counting streams only would overstate the wait there
    # for traffic that is partly whole answers.
    rig = Rig(engine=True, admission_policy="strict")
    await rig.scrape(0.0, running=2)
    async with rig.req(1) as r:
        r.sent()
        for generated in answer:
            r.observe_output_tokens(generated)
    assert len(rig.adm._deadlines.engine_queue._departures) == 1
    rig.assert_drained()


def test_an_arrival_refused_for_the_engines_queue_is_told_both_waits() -> None:
    # The wait ahead in vLLM's queue (2 s) took the whole derived wait (1 s): the message states both.
    limit = WaitLimit(-1.0, True, 0.5, derived=True, engine_queue=2.0)
    error = refusals.deadline_now(limit, retry_after=1.0)
    assert error.message == (
        "Requests wait 2.0 s in the engine's own queue now, and an arriving request may wait 1.0 s in all (the "
        "gateway's queue and the engine's) while the overload is sustained (--ttft-objective auto); retry later.")
    assert error.retry_after == 1.0


@pytest.mark.parametrize(("arrives", "refused"), [
    pytest.param("queued", True, id="requests go on arriving behind them: refused past twice the derived objective"),
    pytest.param("refused at once", True, id="arrivals go on, each refused at once (vLLM's queue takes its whole "
                 "wait): refused all the same"),
    pytest.param(None, False, id="none arrives behind them (a finite burst's stragglers): they wait on"),
])
async def test_once_sustained_a_queued_request_is_refused_past_twice_the_derived_objective(
    arrives: str | None, refused: bool,
) -> None:
    # At 3x the engine's capacity the queue held 150-250 requests when the overload was seen; they waited up to
    # 6-10 s while every arrival behind them was refused at once. Those queued in the surge's first second, before
    # any backlog, waited 6.4-6.9 s at 1,024 blocks.
    rig = Rig(queue_timeout=DEFAULT_QUEUE_TIMEOUT, admission_policy="strict")
    running = [await rig.req(5).__aenter__(), await rig.req(5).__aenter__()]
    first = enter(rig.req(5))  # queued before any backlog
    await settle()
    rig.clock.now += 1.5
    behind = enter(rig.req(1))  # ``first`` has waited past the 1-s wait: ``behind`` arrives into a backlog
    await settle()
    rig.clock.now += 1.1
    rig.adm.tick()  # ``behind`` has waited past the wait itself: sustained
    await settle()
    assert rig.adm.status()["deadlines"]["sustained_overload"] and rig.adm.queued == 2
    rig.clock.now += 1.3  # first tokens no later than 4 s (twice the derived objective of 2 s): both wait on
    arrivals = [enter(rig.req(1))]
    await settle()
    assert not first.done() and not behind.done()

    async def go_on() -> None:
        if arrives == "refused at once":  # over 5 s ahead in vLLM's queue: past the whole 1-s wait
            vllm_queue = rig.adm._deadlines.engine_queue  # 100 waiting there, 8 left it over the last second
            vllm_queue.snapshot(rig.clock.now - 1.0, 0, 100)
            for _ in range(8):
                vllm_queue.departed(rig.clock.now - 1.0)
            assert vllm_queue.ahead(rig.clock.now) > 5.0
            with pytest.raises(errors.DeadlineUnreachable, match="in the engine's own queue"):
                async with rig.req(1):
                    pass
        elif arrives == "queued":
            arrivals.append(enter(rig.req(1)))
        else:
            rig.adm.tick()
        await settle()

    rig.clock.now += 0.2  # ``first`` has waited 4.1 s
    await go_on()
    assert first.done() is refused and not behind.done()
    rig.clock.now += 1.5  # ``behind`` has waited 4.1 s
    await go_on()
    assert behind.done() is refused
    for r in [first, behind] if refused else []:
        with pytest.raises(errors.DeadlineUnreachable, match=r"Waited 4\.1 s in the queue; .* past 4\.0 s, twice the "
                           r"objective derived while the overload is sustained \(--ttft-objective auto\), while "
                           r"requests go on arriving; retry later\.") as caught:
            r.result()
        assert caught.value.code == "deadline" and caught.value.retry_after is not None
    for held in running:
        held.release()
    for task in [first, behind, *arrivals]:
        await settle()
        if not task.done() or task.exception() is None:
            (await task).release()
    rig.assert_drained()


@pytest.mark.parametrize(("objective", "sustained", "unhurried", "bound"), [
    pytest.param("auto", True, 0.1, 4.0, id="auto, sustained, a fast engine: twice the 2-s derived objective"),
    pytest.param("auto", True, 2.5, 10.0, id="auto, sustained, a slow engine: twice its own 5-s objective"),
    pytest.param("auto", False, 0.1, None, id="auto, no overload: a burst waits on"),
    pytest.param(5.0, True, 0.1, None, id="SECONDS: the operator's objective judges each request instead"),
    pytest.param("off", True, 0.1, None, id="off: the queue timeout only"),
])
def test_a_backlog_is_held_to_twice_the_derived_objective_only_while_an_overload_is_sustained_under_auto(
    objective: float | str, sustained: bool, unhurried: float, bound: float | None,
) -> None:
    deadlines = Deadlines(DEFAULT_QUEUE_TIMEOUT, objective, lambda: 0.0)
    for _ in range(MIN_SAMPLES):
        deadlines.first_tokens.add(unhurried)  # admitted as they arrived
    deadlines.sustained.sustained = sustained
    assert deadlines.backlog_bound() == (None if bound is None else pytest.approx(bound))


@pytest.mark.parametrize(("objective", "feedback", "sustained", "held_to"), [
    pytest.param("auto", False, True, 4.0, id="auto, sustained: the backlog's bound, its half the derived objective"),
    pytest.param("auto", True, True, 2.0, id="auto with feedback, sustained: the derived objective itself"),
    pytest.param("auto", False, False, None, id="auto, no overload: no cap, a burst is served as it comes"),
    pytest.param(5.0, False, True, 5.0, id="SECONDS: the operator's objective"),
    pytest.param("off", False, True, None, id="off: no cap"),
])
def test_the_pace_holds_the_admitted_to_the_objective_arrivals_are_held_to_else_to_the_backlogs_bound(
    objective: float | str, feedback: bool, sustained: bool, held_to: float | None,
) -> None:
    deadlines = Deadlines(DEFAULT_QUEUE_TIMEOUT, objective, lambda: 0.0, feedback=feedback)
    for _ in range(MIN_SAMPLES):
        deadlines.first_tokens.add(0.1)  # admitted as they arrived: the floor's 1-s wait, a 2-s derived objective
    deadlines.sustained.sustained = sustained
    assert deadlines.pace_objective() == (None if held_to is None else pytest.approx(held_to))


async def test_under_a_sustained_overload_the_engines_own_time_past_the_derived_objective_caps_the_requests_in_flight(
) -> None:
    """The default, where the cache does not bind first: KV blocks admit every arrival and the engine's own time to a
    first token grows past the derived objective (2 s); the pace's cap then holds the requests in flight, and an
    arrival whose turn under it comes past 80% of the derived wait is refused at once."""
    rig = Rig(engine=True, queue_timeout=DEFAULT_QUEUE_TIMEOUT, admission_policy="strict")
    await rig.scrape(0.0, running=2, waiting=3)  # admitted into vLLM's own queue: no sample of its unhurried time
    # First tokens 2.5 s after admission (past the derived objective of 2 s, the floor's); five end, at 5 a second.
    running = await five_running_after_slow_first_tokens(rig, 2.5)
    deadlines = rig.adm._deadlines
    deadlines.steer(len(running), False, 0)
    assert deadlines.status()["pace_cap"] is None  # no sustained overload: nothing holds the engine's time
    # The overload, seen in the engine's own queue (the gateway's stays empty where KV room admits every arrival).
    deadlines.sustained.engine_backlog(rig.clock.now, begins=True)
    deadlines.steer(len(running), False, 0)
    assert deadlines.status()["pace_cap"] == 4  # 80% of the five in flight
    waiting = [enter(rig.req(1)) for _ in range(3)]
    await settle()
    assert rig.adm.in_flight == 5 and rig.adm.queued == 3  # blocks are free: the cap holds them
    # The derived wait is the floor's 1 s, 80% of it 0.8 s: the fourth in line, at 5 a second, takes 0.8 s; the
    # fifth 1.0 s.
    fourth = enter(rig.req(1))
    await settle()
    assert rig.adm.queued == 4 and not fourth.done()
    with pytest.raises(errors.DeadlineUnreachable, match=(
        r"Expected wait 1\.0 s for one of the 4 requests the engine runs at once within 4\.0 s, twice the objective "
        r"derived while the overload is sustained \(--ttft-objective auto\), exceeds 80% of the 1\.0 s the request "
        r"may wait \(4 ahead of it, 5\.0 requests end a second\); retry later\.")) as caught:
        await rig.req(1).__aenter__()
    assert caught.value.code == "deadline" and caught.value.retry_after is not None and rig.adm.queued == 4
    for task in [*waiting, fourth]:
        task.cancel()
    await asyncio.gather(*waiting, fourth, return_exceptions=True)
    for r in running:
        r.release()
    rig.assert_drained()
