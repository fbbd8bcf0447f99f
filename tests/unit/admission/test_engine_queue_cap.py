"""An engine whose own queue cap refused a request (``engine/queue_cap.py``) is full to admission: a request goes to
another engine though that one has less room, or, with none, waits until the engine has room again."""

from __future__ import annotations

from tests.unit.admission.rig import enter, settle
from tests.unit.admission.test_several_engines import engines, target


async def test_an_engine_that_refused_takes_nothing_though_it_has_the_most_room() -> None:
    pool = await engines(20, 10)
    pool.views[0].queue_cap.refused(1.0)
    r = await pool.admitted(4)
    assert target(r) == "1"
    r.release()
    pool.assert_drained()


async def test_alone_it_takes_the_next_request_once_one_of_its_requests_ends() -> None:
    pool = await engines(20)
    running = await pool.admitted(4)
    pool.views[0].queue_cap.refused(1.0)
    waiting = enter(pool.req(4))
    await settle()
    assert not waiting.done() and pool.adm.queued == 1
    pool.views[0].queue_cap.room()  # as the exchange does when a request leaves the engine
    running.release()
    next_one = await waiting
    assert target(next_one) == "0"
    next_one.release()
    pool.assert_drained()


async def test_alone_and_with_nothing_of_ours_on_it_it_takes_requests_again_after_the_hold() -> None:
    pool = await engines(20)
    pool.views[0].queue_cap.refused(1.0)
    waiting = enter(pool.req(4))
    await settle()
    assert not waiting.done()
    pool.clock.now += 1.0
    await pool.scrape()  # the next snapshot re-examines the queue
    r = await waiting
    r.release()
    pool.assert_drained()
