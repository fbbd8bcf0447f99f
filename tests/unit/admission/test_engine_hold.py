"""One engine held for its restart while the others serve (``Admission.hold``, ``EngineControl``): the held
engine takes nothing new, even alone; its requests in flight are waited for on their own; released, it takes
requests again."""

from __future__ import annotations

import asyncio

from gateway.admission.engine_control import EngineControl
from tests.unit.admission.rig import enter, settle
from tests.unit.admission.test_several_engines import engines, target


async def test_a_held_engine_takes_nothing_though_it_has_the_most_room() -> None:
    pool = await engines(20, 10)
    pool.adm.hold(0)
    r = await pool.admitted(4)
    assert target(r) == "1"
    assert pool.adm.status()["held_engines"] == ["0"]
    r.release()
    pool.assert_drained()


async def test_with_every_engine_held_requests_wait_until_one_comes_back() -> None:
    pool = await engines(10, 10)
    for engine in (0, 1):
        pool.adm.hold(engine)
    r = pool.req(4)
    waiting = enter(r)
    await settle()
    assert not waiting.done() and pool.adm.queued == 1
    pool.adm.hold(1, False)
    await waiting
    assert target(r) == "1"
    r.release()
    pool.assert_drained()


async def test_a_request_that_avoids_the_only_open_engine_still_never_goes_to_a_held_one() -> None:
    pool = await engines(10, 10)
    pool.adm.hold(0)
    r = await pool.admitted(4, avoid=frozenset({"1"}))
    assert target(r) == "1"
    r.release()
    pool.assert_drained()


async def test_an_engines_control_pauses_and_drains_only_that_engine() -> None:
    pool = await engines(10, 10)
    on_0, on_1 = await pool.admitted(8), await pool.admitted(8)
    assert (target(on_0), target(on_1)) == ("0", "1")
    control = EngineControl(pool.adm, 1, clock=pool.clock, sleep=pool.sleep)
    control.pause()
    assert control.in_flight == 1 and pool.adm.in_flight == 2
    draining = asyncio.ensure_future(control.wait_idle(5.0))
    await settle()
    assert not draining.done()
    on_0.release()  # another engine's request ending drains nothing of engine 1
    await pool.sleep.wake_and_run()
    assert not draining.done()
    on_1.release()
    await pool.sleep.wake_and_run()
    assert await draining is True
    control.resume()
    after = await pool.admitted(9)
    assert pool.adm.status()["held_engines"] == [] and target(after) in {"0", "1"}
    after.release()
    pool.assert_drained()


async def test_draining_an_engine_gives_up_at_the_timeout_with_its_request_still_running() -> None:
    pool = await engines(10, 10)
    r = await pool.admitted(8)
    control = EngineControl(pool.adm, int(target(r) or 0), clock=pool.clock, sleep=pool.sleep)
    draining = asyncio.ensure_future(control.wait_idle(3.0))
    await settle()
    pool.clock.now += 3.0
    await pool.sleep.wake_and_run()
    assert await draining is False and control.in_flight == 1
    r.release()
    pool.assert_drained()
