"""The adaptive policy: admitting past the ledger on the projection, backing off, and falling back to the ledger."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.admission import Reservation
from gateway.admission.projection import Outlook, Projector, credited_progress
from gateway.engine.live import never_scraped
from tests.unit.admission.booked import EIGHT, Booked
from tests.unit.admission.rig import Rig, adaptive_rig_with_short_outputs, enter, release_all, settle, vllm_text


# -- adaptive, through the controller --------------------------------------------------------------
@pytest.mark.parametrize(("policy", "admitted"), [("strict", 0), ("adaptive", 5)])
async def test_adaptive_admits_past_the_ledger_when_requests_stop_early(policy: str, admitted: int) -> None:
    rig, running = await adaptive_rig_with_short_outputs(policy)
    extra = [rig.req(10) for _ in range(5)]
    tasks = [enter(r) for r in extra]
    await settle()
    assert sum(r.admitted for r in extra) == admitted
    status = rig.adm.status()
    assert status["output_lengths"] == {"/<=256": 8} and status["live_used_blocks"] == 10
    if policy == "adaptive":
        assert rig.adm.committed == 150
        assert status["admit_limit_blocks"] > status["budget_blocks"] == 100
    await release_all(rig, running + extra, tasks)


async def test_an_arrival_reuses_the_projection_that_a_release_or_a_snapshot_redoes() -> None:
    rig, running = await adaptive_rig_with_short_outputs()
    rig.clock.now += 0.1
    await rig.scrape(0.95)  # the engine nearly full: arrivals wait
    extra = [rig.req(10) for _ in range(10)]
    tasks = [enter(r) for r in extra]
    await settle()
    queued = rig.adm.queued
    assert 0 < queued < 10
    policy = rig.adm._sites.primary.policy
    before = policy.projections
    later = [rig.req(10) for _ in range(3)]
    tasks += [enter(r) for r in later]
    await settle()
    assert rig.adm.queued == queued + 3
    arrivals = policy.projections - before
    assert arrivals < len(later)  # nothing moved: kept (a pass per arrival projected each time before)
    running.pop().release()
    assert policy.projections - before > arrivals  # a release moves the books: projected again
    released = policy.projections
    rig.clock.now += 0.1
    await rig.scrape(0.10)
    assert policy.projections > released  # a snapshot moves the engine: projected again
    await release_all(rig, running + extra + later, tasks)


async def test_adaptive_backs_off_on_preemptions_past_the_budget_and_recovers_additively() -> None:
    rig, running = await adaptive_rig_with_short_outputs()
    for preemptions in (1, 2, 3, 4, 5):  # a preemption a second, 8 requests completed: past 1 per 100
        for r in running:
            r.observe_output_tokens(8 + preemptions)
        rig.clock.now += 1.0
        await rig.scrape(0.20, preemptions=preemptions)
    assert rig.adm.optimism == 0.0  # 1 -> 1/2 -> ... -> 1/32, below the floor: booked at the worst case
    extra = rig.req(10)
    task = enter(extra)
    await settle()
    # Each running request holds 2 blocks (8 + 13 tokens) and may grow by 8: 20 + 10 x 8 + 10 > 100.
    assert not extra.admitted
    for _ in range(5):
        rig.clock.now += 1.0
        for r in running:
            r.observe_output_tokens(16)
        await rig.scrape(0.20, preemptions=5)
    assert rig.adm.optimism == pytest.approx(0.25)
    await release_all(rig, [*running, extra], [task])


async def test_adaptive_trusts_only_the_ledger_when_metrics_go_stale() -> None:
    rig, running = await adaptive_rig_with_short_outputs()
    rig.clock.now += 2.5
    extra = rig.req(10)
    task = enter(extra)
    await settle()
    rig.adm.tick()
    assert not extra.admitted and rig.adm.status()["engine"]["stale"] is True
    rig.upstream.down = True
    await rig.view.refresh()  # type: ignore[union-attr]
    assert not extra.admitted
    rig.upstream.down = False
    for r in running:
        r.observe_output_tokens(9)
    rig.clock.now += 0.1
    await rig.scrape(0.10)
    assert extra.admitted  # fresh again
    await release_all(rig, [*running, extra], [task])


async def test_adaptive_without_engine_metrics_is_the_ledger() -> None:
    rig, running = await adaptive_rig_with_short_outputs()
    rig.upstream.text = vllm_text(0.1).replace("vllm:kv_cache_usage_perc", "other_usage")
    await rig.view.refresh()  # type: ignore[union-attr]
    extra = rig.req(10)
    task = enter(extra)
    await settle()
    assert not extra.admitted
    await release_all(rig, [*running, extra], [task])


@pytest.mark.parametrize(("progress", "admitted"), [(True, 4), (False, 4)])
async def test_adaptive_counts_in_flight_requests_at_their_expected_end(progress: bool, admitted: int) -> None:
    """Requests of a 152-token prompt allowed 168 tokens (20 blocks) stop after 8: five fill the ledger
    and hold 10 blocks each. Seen progressing, each may add 1 block on top of live usage (50 + 5 + 4 x 11
    <= 100). Not seen since the snapshot's window, it may be waiting or preempted, so live usage may not hold
    it; but the five together end at 5 x 11 = 55 blocks whatever they hold now (55 + 4 x 11 <= 100), so
    unknown progress no longer counts what a request holds twice."""
    rig = Rig(engine=True)
    await rig.scrape(0.0)
    for _ in range(8):
        async with rig.req(20, prompt=152) as done:
            done.observe_output_tokens(8)
    running = [await rig.req(20, prompt=152).__aenter__() for _ in range(5)]
    for r in running:
        r.observe_output_tokens(8)
    rig.clock.now += 0.1 if progress else 1.0
    await rig.scrape(0.50)
    extra = [rig.req(20, prompt=152) for _ in range(6)]
    tasks = [enter(r) for r in extra]
    await settle()
    assert sum(r.admitted for r in extra) == admitted
    await release_all(rig, running + extra, tasks)


# -- what the projection learns -------------------------------------------------------------------------
def test_credited_progress_is_the_newest_checkpoint_in_the_window_less_what_runs_ahead() -> None:
    checkpoints = [(1.0, 10), (1.5, 20), (2.5, 30)]
    assert credited_progress(checkpoints, 2.0, 1.0, 1) == 20 - 4
    assert credited_progress(checkpoints, 3.0, 1.0, 2) == 30 - 6
    assert credited_progress(checkpoints, 2.0, 0.4, 1) is None  # nothing seen shortly before
    assert credited_progress([(1.0, 3)], 1.0, 1.0, 1) == 0


def test_the_projector_credits_progress_on_good_snapshots_and_forgets_it_on_bad_ones() -> None:
    projector = Projector(credit_window=0.5)
    good = replace(never_scraped(1.0), ok=True, has_metrics=True, preemptions_total=0.0)
    running = [Booked(generated=8)]
    projector.observe(never_scraped(0.0), good, running)
    assert running[0].credited == 8 and running[0].credits == 1
    projector.observe(good, replace(good, taken_at=2.0, preemptions_total=3.0), running)
    assert projector.optimism.value == 0.5
    projector.observe(good, never_scraped(3.0), running)
    assert running[0].credited is None and projector.optimism.value == 0.5
    assert projector.outlook() == Outlook(0.85, projector.outputs)


@pytest.mark.parametrize(("min_output", "learned"), [(0, 1), (40, 1), (168, 0)],
                         ids=["nothing known", "min_tokens: its length is an answer's", "ignore_eos: forced"])
def test_answers_forced_to_max_tokens_are_not_learned(min_output: int, learned: int) -> None:
    projector = Projector(credit_window=0.5)
    projector.completed(Booked(min_output=min_output), 168, 1.0)
    assert sum(projector.outputs.status().values()) == learned


def test_the_outlook_books_what_a_request_surely_generates() -> None:
    short = Outlook(0.7, EIGHT)
    assert short.expected_output(Booked()) == 8
    assert short.expected_output(Booked(min_output=100)) == 100
    assert short.expected_output(Booked(min_output=168)) == 168


@pytest.mark.parametrize(
    ("held_back", "kv_usage", "kv_target", "allowed", "reach"),
    [
        (True, 0.5, 1.0, True, 0.2),  # requests wait in the gateway while the engine has room: 4 s of reach
        (False, 0.5, 1.0, True, 0.0),  # nothing waits in the gateway: the engine's room is the load's
        (True, 0.95, 1.0, True, 0.0),  # the engine near full: no room the projection misses
        (True, 0.5, 0.5, True, 0.0),  # at its operator's KV target already
        # The engine's first tokens take all the TTFT objective leaves them: room in the cache is not time in it.
        (True, 0.5, 1.0, False, 0.0),
    ],
)
def test_the_reach_grows_only_while_requests_wait_in_the_gateway_and_the_engine_has_room(
    held_back: bool, kv_usage: float, kv_target: float, allowed: bool, reach: float
) -> None:
    projector = Projector(credit_window=0.5, kv_target=kv_target)
    snap = replace(never_scraped(0.0), ok=True, has_metrics=True, preemptions_total=0.0, kv_usage=kv_usage, waiting=0)
    for second in range(1, 5):
        new = replace(snap, taken_at=float(second))
        projector.observe(snap, new, [], held_back=held_back, compute_room=allowed)
        snap = new
    assert projector.outlook().reach == pytest.approx(reach)


def test_the_reach_is_taken_away_once_the_engine_has_no_time_left_within_the_objective() -> None:
    projector = Projector(credit_window=0.5)
    snap = replace(never_scraped(0.0), ok=True, has_metrics=True, preemptions_total=0.0, kv_usage=0.5, waiting=0)
    for second, compute in ((1, True), (2, True), (3, True), (4, False)):
        new = replace(snap, taken_at=float(second))
        projector.observe(snap, new, [], held_back=True, compute_room=compute)
        snap = new
        assert projector.outlook().reach == pytest.approx(0.05 * second if compute else 0.0)


@pytest.mark.parametrize(("declared", "admitted"), [(True, False), (False, True)],
                         ids=["ignore_eos: within the budget only", "its length unknown: the reach takes it"])
async def test_the_reach_past_the_budget_never_takes_a_request_that_declares_its_whole_length(
    declared: bool, admitted: bool
) -> None:
    rig = Rig(engine=True, admission_policy="adaptive")
    await rig.scrape(0.0)
    rig.adm._sites.primary.projector.optimism.value = 1.5  # the most reach: the engine had room for long

    def sure(i: int) -> Reservation:
        return rig.adm.reservation(prompt_tokens=8, max_tokens=712, n=1, priority=0, request_id=f"r{i}",
                                   min_output=712)

    running = [await sure(i).__aenter__() for i in range(2)]
    for r in running:
        r.observe_output_tokens(704)  # 45 blocks of 16 each, 90 of the 100, to the end surely
    # The third: 200 prompt tokens (13 blocks at once, 103 in all: past the budget, within the reach).
    extra = rig.adm.reservation(prompt_tokens=200, max_tokens=312, n=1, priority=0, request_id="third",
                                min_output=312 if declared else 0)
    task = enter(extra)
    await settle()
    assert extra.admitted == admitted
    await release_all(rig, [*running, extra], [task])
