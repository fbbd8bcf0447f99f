"""Shedding at once: a queued request the forecast says will not be admitted before its deadline is refused then,
with the expected wait as Retry-After; one that will be admitted in time waits; nobody is shed while the forecast
is unknown or admission is paused; and every refusal gives its place back."""

from __future__ import annotations

import asyncio

import pytest

from gateway import errors
from gateway.admission import Reservation
from gateway.admission.forecast import MIN_RELEASES
from gateway.http.errors import error_headers, status_and_type
from tests.unit.admission.rig import Rig, enter, settle

# The rig's budget is 10 blocks; ``steady`` keeps two requests of 5 blocks in flight and one waiting, and ends
# one each second of backlog: 5 blocks freed per second. After 36 releases the margin is 1.35x (6.75 blocks/s).


async def steady(rig: Rig, releases: int) -> tuple[list[Reservation], Reservation, asyncio.Task[Reservation]]:
    """An engine at its budget with a queue: returns the requests in flight, the waiting one and its task."""
    running = [await rig.req(5).__aenter__(), await rig.req(5).__aenter__()]
    waiting = rig.req(5)
    task = enter(waiting)
    await settle()
    for _ in range(releases):
        rig.clock.now += 1.0
        running.pop(0).release()
        running.append(await task)
        waiting = rig.req(5)
        task = enter(waiting)
        await settle()
    return running, waiting, task


async def finish(rig: Rig, running: list[Reservation], task: asyncio.Task[Reservation]) -> None:
    for r in running:
        r.release()
    (await task).release()
    rig.assert_drained()


async def test_a_hopeless_request_is_refused_at_once_with_the_expected_wait_as_retry_after() -> None:
    rig = Rig(queue_timeout=2.0, admission_policy="strict")  # arrival order
    running, _, task = await steady(rig, 36)
    # 5 blocks wait ahead of its 10: 15 / 5 per second = 3 s. The clock stands still and no sleeper is woken:
    # the refusal comes without waiting at all.
    with pytest.raises(errors.QueueTimeoutExpected) as caught:
        await rig.req(10).__aenter__()
    refusal = caught.value
    assert status_and_type(refusal) == (503, "server_error")
    assert refusal.code == "queue_timeout_expected"
    assert refusal.retry_after == pytest.approx(3.0) and error_headers(refusal)["retry-after"] == "3"
    assert refusal.message == (
        "Expected wait 3.0 s for KV capacity exceeds 80% of the queue timeout of 2 s (ahead of it: 1 request needing "
        "5 KV blocks; 2 requests in flight free 5.0 blocks/s); retry later."
    )
    assert (rig.adm.queued, rig.adm.committed) == (1, 10)  # its place given back, the books untouched
    await finish(rig, running, task)


async def test_a_request_served_shortly_is_queued_and_admitted() -> None:
    rig = Rig(queue_timeout=2.0, admission_policy="strict")  # arrival order
    running, _, task = await steady(rig, 36)
    soon = enter(rig.req(1))  # 6 blocks to free: 1.2 s at the rate seen, within the timeout
    await settle()
    assert rig.adm.queued == 2 and not soon.done()
    rig.clock.now += 1.0
    running.pop(0).release()
    running.append(await task)
    running.pop(0).release()  # the 6th block
    admitted = await soon
    assert admitted.admitted and admitted.queue_ms == pytest.approx(1000.0)
    running.append(admitted)
    for r in running:
        r.release()
    rig.assert_drained()


@pytest.mark.parametrize(
    ("releases", "shed_early", "paused"),
    [
        pytest.param(MIN_RELEASES - 1, "on", False, id="too few releases seen"),
        pytest.param(36, "off", False, id="switched off"),
        pytest.param(36, "on", True, id="admission paused for a restart"),
    ],
)
async def test_without_a_forecast_to_act_on_a_request_waits_out_its_timeout(
    releases: int, shed_early: str, paused: bool
) -> None:
    rig = Rig(queue_timeout=2.0, shed_early=shed_early, admission_policy="strict")
    running, _, task = await steady(rig, releases)
    if paused:
        rig.adm.pause()
    hopeless = enter(rig.req(10))
    await settle()
    assert not hopeless.done() and rig.adm.queued == 2
    rig.clock.now += 2.0
    rig.adm.tick()
    for waited in (hopeless, task):  # the old answer, after the whole wait
        with pytest.raises(errors.QueueTimeout) as caught:
            await waited
        assert type(caught.value) is errors.QueueTimeout
    rig.adm.resume()
    for r in running:
        r.release()
    rig.assert_drained()


async def test_nothing_in_flight_sheds_nothing() -> None:
    rig = Rig(queue_timeout=2.0, max_concurrency=2, admission_policy="strict")
    running, waiting, task = await steady(rig, 36)
    for r in running:
        r.release()
    await settle()
    assert rig.adm.in_flight == 1 and waiting.admitted  # the engine is not the limit now
    waiting.release()
    await settle()
    rig.assert_drained()
    await task


async def test_an_arriving_request_is_judged_at_the_rate_seen_not_waited_on_for_a_later_refusal() -> None:
    rig = Rig(queue_timeout=2.0, admission_policy="strict")  # arrival order
    running, _, task = await steady(rig, 36)
    # 13 blocks to free: 2.6 s at the rate seen (1.9 s at the margin's faster rate): refused as it arrives.
    with pytest.raises(errors.QueueTimeoutExpected) as caught:
        await rig.req(8).__aenter__()
    assert "Expected wait 2.6 s for KV capacity exceeds 80% of the queue timeout of 2 s" in caught.value.message
    assert rig.adm.queued == 1
    await finish(rig, running, task)


async def test_a_request_whose_wait_grew_past_what_is_left_learns_it_then() -> None:
    rig = Rig(queue_timeout=2.0, admission_policy="strict")  # arrival order
    running, _, task = await steady(rig, 36)
    # 8 blocks to free: 1.6 s at the rate seen, 80% of the timeout: queued.
    stalled = enter(rig.req(3))
    await settle()
    assert rig.adm.queued == 2
    rig.clock.now += 0.5  # no release meanwhile: 1.5 s left, 1.2 s at the margin's rate: kept, as it is not sure
    rig.adm.tick()
    await settle()
    assert rig.adm.queued == 2
    rig.clock.now += 0.5  # 1 s left
    rig.adm.tick()
    with pytest.raises(errors.QueueTimeoutExpected) as caught:
        await stalled
    assert "Expected wait 1.6 s for KV capacity exceeds the 1.0 s left of the 2 s queue timeout" in caught.value.message
    assert rig.adm.queued == 1  # the request ahead of it still makes it: kept
    await finish(rig, running, task)


async def test_refusals_leave_the_books_and_the_queue_as_they_were() -> None:
    rig = Rig(queue_timeout=2.0, admission_policy="strict")  # arrival order
    running, _, task = await steady(rig, 36)
    for _ in range(5):
        with pytest.raises(errors.QueueTimeoutExpected):
            await rig.req(10).__aenter__()
    assert (rig.adm.committed, rig.adm.in_flight, rig.adm.queued) == (10, 2, 1)
    assert rig.adm.status()["forecast"] == {"enabled": True, "blocks_freed_per_s": 5.0, "releases": 36, "ready": True}
    await finish(rig, running, task)
