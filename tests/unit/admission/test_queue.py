"""The queue: shedding, deadlines, Retry-After, priority order, fair shares between tenants, the starvation bound,
pause and shutdown."""

from __future__ import annotations

import pytest

from gateway import errors
from gateway.admission import Reservation
from gateway.admission.queue import PASSERS_TRIED, Drain, WaitQueue
from gateway.http.errors import error_headers, status_and_type
from tests.unit.admission.rig import BS, Rig, enter, settle


# -- shedding and deadlines ------------------------------------------------------------------------
async def test_no_queue_sheds_at_once_with_429() -> None:
    rig = Rig(max_queue=0)
    holder = await rig.req(10).__aenter__()
    with pytest.raises(errors.QueueFull) as caught:
        await rig.req(1).__aenter__()
    assert status_and_type(caught.value)[0] == 429 and error_headers(caught.value)["retry-after"] == "5"
    assert "queue is full (0 requests waiting" in caught.value.message
    holder.release()
    rig.assert_drained()


async def test_retry_after_follows_the_observed_drain_rate() -> None:
    rig = Rig(max_queue=1)
    for _ in range(6):
        rig.clock.now += 2.0
        async with rig.req(10):
            pass
    holder = await rig.req(10).__aenter__()
    waiting = enter(rig.req(1))
    await settle()
    with pytest.raises(errors.QueueFull) as caught:
        await rig.req(1).__aenter__()
    # 6 releases over the last 10 s: 0.6 per second; second in line: 2 / 0.6 = 3.3 s.
    assert caught.value.retry_after == pytest.approx(2 / 0.6)
    assert error_headers(caught.value)["retry-after"] == "4"
    holder.release()
    (await waiting).release()
    rig.assert_drained()


async def test_a_queued_request_times_out_with_503_at_its_deadline() -> None:
    rig = Rig(queue_timeout=30.0)
    holder = await rig.req(10).__aenter__()
    waiting = enter(rig.req(1))
    await settle()
    rig.clock.now += 29.9
    rig.adm.tick()
    await settle()
    assert not waiting.done()
    rig.clock.now += 0.2
    rig.adm.tick()
    with pytest.raises(errors.QueueTimeout) as caught:
        await waiting
    assert status_and_type(caught.value)[0] == 503 and 1 <= int(error_headers(caught.value)["retry-after"]) <= 60
    assert "Waited 30.1 s for KV capacity, the queue timeout is 30 s" in caught.value.message
    holder.release()
    rig.assert_drained()


async def test_the_deadline_timer_sleeps_until_the_oldest_deadline() -> None:
    rig = Rig(queue_timeout=30.0)
    holder = await rig.req(10).__aenter__()
    first = enter(rig.req(1))
    await settle()
    rig.clock.now += 10.0
    second = enter(rig.req(1))
    await settle()
    assert rig.sleep.delays == [30.0]
    rig.clock.now += 20.0
    rig.sleep.wake()
    with pytest.raises(errors.QueueTimeout):
        await first
    await settle()
    assert not second.done() and rig.sleep.delays == [30.0, 10.0]
    holder.release()
    (await second).release()
    await settle()
    assert rig.sleep.pending[0].cancelled()  # the timer stops with an empty queue
    rig.assert_drained()


# -- order: priority, FIFO, starvation bound -------------------------------------------------------
async def test_higher_priority_first_then_fifo() -> None:
    rig = Rig(max_concurrency=1)
    holder = await rig.req(1).__aenter__()
    named = {name: rig.req(1, prio) for name, prio in [("low1", 0), ("high1", 5), ("low2", 0), ("high2", 5)]}
    tasks = {name: enter(r) for name, r in named.items()}
    await settle()
    assert rig.adm.status()["queued_by_priority"] == {"5": 2, "0": 2}
    order: list[str] = []
    current = holder
    for _ in named:
        current.release()
        await settle()
        (name,) = [n for n, r in named.items() if r.admitted]
        order.append(name)
        current = await tasks[name]
    current.release()
    assert order == ["high1", "high2", "low1", "low2"]
    rig.assert_drained()


async def test_smaller_requests_pass_a_blocked_head_at_most_the_starvation_bound() -> None:
    rig = Rig(starvation_bound=2, admission_policy="strict")  # arrival order: the big one is the head
    holder = await rig.req(6).__aenter__()
    big = rig.req(8)
    smalls = [rig.req(1) for _ in range(3)]
    tasks = [enter(r) for r in [big, *smalls]]
    await settle()
    assert [r.admitted for r in [big, *smalls]] == [False, True, True, False]
    holder.release()
    await settle()
    assert [r.admitted for r in [big, *smalls]] == [True, True, True, False]
    for r in [big, *smalls[:2]]:
        r.release()
    await settle()
    assert smalls[2].admitted
    for t in tasks:
        (await t).release()
    rig.assert_drained()


# -- tenants ----------------------------------------------------------------------------------------
def tenant_req(rig: Rig, tenant: str, weight: float = 1.0, *, prompt: int = 8, priority: int = 0) -> Reservation:
    """A one-block request of ``tenant``."""
    return rig.adm.reservation(prompt_tokens=prompt, max_tokens=BS - prompt, n=1, priority=priority,
                               request_id=tenant, tenant=tenant, weight=weight)


@pytest.mark.parametrize(
    ("fair", "expected"),
    [
        ("on", ["b1", "a1", "b2", "a2", "a3"]),  # the tenant furthest behind next; ties: the one with fewer waiting
        ("off", ["b1", "a1", "a2", "a3", "b2"]),  # priority first, then arrival
    ],
)
async def test_fair_queueing_serves_tenants_in_turns_or_by_priority_when_off(fair: str, expected: list[str]) -> None:
    rig = Rig(max_concurrency=1, fair_queueing=fair)
    holder = await tenant_req(rig, "a").__aenter__()
    queued = {
        "a1": tenant_req(rig, "a"), "a2": tenant_req(rig, "a"), "a3": tenant_req(rig, "a"),
        "b1": tenant_req(rig, "b", priority=3), "b2": tenant_req(rig, "b"),
    }
    order: list[str] = []
    tasks = {name: enter(r) for name, r in queued.items()}
    await settle()
    current = holder
    for _ in queued:
        current.release()
        await settle()
        (name,) = [n for n, r in queued.items() if r.admitted]
        order.append(name)
        current = await tasks.pop(name)
    current.release()
    assert order == expected and rig.adm.status()["fair_queueing"] is (fair == "on")
    rig.assert_drained()


async def test_status_shows_each_tenants_weight_counter_and_queued_requests() -> None:
    rig = Rig(max_concurrency=1)
    holder = await tenant_req(rig, "a", 2.0, prompt=10).__aenter__()
    waiting = [enter(tenant_req(rig, "b", 0.5)), enter(tenant_req(rig, "b", 0.5))]
    await settle()
    holder.observe_output_tokens(5)
    # The headroom's figures (``test_headroom_controller``): the blocks each holds, its recent demand, and the
    # blocks kept free for it, up to its fair share (a: 8 of the 10 blocks, b: 2).
    assert rig.adm.status()["tenants"] == {
        "a": {"weight": 2.0, "counter": 5.0, "queued": 0,  # the prompt's 10 tokens over weight 2
              "active": True, "held_blocks": 1, "demand_blocks": 1, "headroom_blocks": 0},
        "b": {"weight": 0.5, "counter": 5.0, "queued": 2,  # lifted to the waiting tenants' smallest: a's
              "active": True, "held_blocks": 0, "demand_blocks": 2, "headroom_blocks": 2},
    }
    holder.release()  # the output is charged when the request ends: 5 tokens x 2 / 2
    await settle()
    assert rig.adm.status()["tenants"]["a"] == {"weight": 2.0, "counter": 10.0, "queued": 0,
                                                "active": True, "held_blocks": 0, "demand_blocks": 1,
                                                "headroom_blocks": 1}
    assert rig.adm.status()["tenants"]["b"] == {"weight": 0.5, "counter": 21.0, "queued": 1,
                                                "active": True, "held_blocks": 1, "demand_blocks": 2,
                                                "headroom_blocks": 1}
    for t in waiting:
        (await t).release()
        await settle()
    rig.assert_drained()


# -- pause and shutdown ----------------------------------------------------------------------------
async def test_pause_holds_the_queue_and_its_deadlines_still_run() -> None:
    rig = Rig(queue_timeout=5.0)
    rig.adm.pause()
    early = enter(rig.req(1))
    await settle()
    rig.clock.now += 5.0
    late = enter(rig.req(1))
    await settle()
    assert rig.adm.in_flight == 0
    with pytest.raises(errors.QueueTimeout):
        await early
    rig.adm.resume()
    (await late).release()
    rig.assert_drained()


async def test_close_turns_waiting_requests_away() -> None:
    rig = Rig()
    holder = await rig.req(10).__aenter__()
    waiting = enter(rig.req(1))
    await settle()
    await rig.adm.close()
    with pytest.raises(errors.UpstreamUnavailable):
        await waiting
    holder.release()
    rig.assert_drained()


# -- the queue on its own -----------------------------------------------------------------------------
class Item:
    def __init__(self, name: str, priority: int = 0, blocks: int = 1, tenant: str = "default") -> None:
        self.name = name
        self.priority = priority
        self.blocks = blocks
        self.tenant = tenant
        self.weight = 1.0

    def __repr__(self) -> str:
        return self.name


def names(queue: WaitQueue[Item]) -> list[str]:
    return [i.name for i in queue]


def test_the_queue_orders_by_priority_then_arrival_and_counts_depth() -> None:
    queue: WaitQueue[Item] = WaitQueue(starvation_bound=8)
    items = [Item("low1"), Item("high1", 5), Item("low2"), Item("high2", 5), Item("mid", 2)]
    for at, item in enumerate(items):
        queue.push(item, float(at), float(at) + 30)
    assert names(queue) == ["high1", "high2", "mid", "low1", "low2"]
    assert dict(queue.depth) == {0: 2, 5: 2, 2: 1}
    assert [queue.position(i) for i in items] == [3, 0, 4, 1, 2]
    assert queue.head() is items[1] and queue.enqueued_at(items[2]) == 2.0
    assert queue.remove(items[4]) and not queue.remove(items[4])
    assert items[4] not in queue and items[0] in queue
    assert dict(queue.depth) == {0: 2, 5: 2}
    for item in items[:4]:
        queue.remove(item)
    assert len(queue) == 0 and queue.head() is None and dict(queue.depth) == {}
    assert queue.nearest_deadline() is None


def test_the_queue_reports_expired_requests_in_its_order() -> None:
    queue: WaitQueue[Item] = WaitQueue(starvation_bound=8)
    a, b, c = Item("a"), Item("b", 3), Item("c")
    queue.push(a, 0.0, 10.0)
    queue.push(b, 1.0, 11.0)
    queue.push(c, 5.0, 15.0)
    assert queue.nearest_deadline() == 10.0
    assert queue.expired(9.9) == []
    assert queue.expired(11.0) == [b, a]
    assert len(queue) == 3  # reporting removes nothing


def test_pick_lets_smaller_requests_pass_a_blocked_head_up_to_the_bound() -> None:
    queue: WaitQueue[Item] = WaitQueue(starvation_bound=2)
    big, bigger, small1, small2, small3 = Item("big", blocks=8), Item("bigger", blocks=9), *(
        Item(f"small{i}", blocks=1) for i in (1, 2, 3)
    )
    for at, item in enumerate([big, bigger, small1, small2, small3]):
        queue.push(item, float(at), 100.0)
    room = 1

    def fits(item: Item) -> bool:
        return item.blocks <= room

    assert queue.pick(fits) is small1  # a larger request never passes the head
    queue.remove(small1)
    assert queue.pick(fits) is small2
    queue.remove(small2)
    assert queue.pick(fits) is None  # passed twice: the head goes first now
    room = 8
    assert queue.pick(fits) is big
    queue.remove(big)
    assert queue.pick(lambda item: False) is None
    assert WaitQueue[Item](starvation_bound=0).pick(fits) is None


def test_a_pass_tries_only_the_first_smaller_requests_behind_a_blocked_head() -> None:
    queue: WaitQueue[Item] = WaitQueue(starvation_bound=8)
    head = Item("head", blocks=8)
    queue.push(head, 0.0, 100.0)
    smaller = [Item(f"small{i}", blocks=2) for i in range(PASSERS_TRIED)]
    for at, item in enumerate([*smaller, Item("larger", blocks=9), Item("last", blocks=1)], start=1):
        queue.push(item, float(at), 100.0)
    tried: list[str] = []

    def fits(item: Item) -> bool:
        tried.append(item.name)
        return item.name == "last"

    assert queue.pick(fits) is None  # "last" fits, but comes after the requests a pass tries
    assert tried == ["head", *(i.name for i in smaller)]
    queue.remove(smaller[0])
    assert queue.pick(fits) is not None and tried[-1] == "last"  # one place further up: now within reach


def test_drain_rate_and_retry_after_read_the_last_minute_without_changing_it() -> None:
    drain = Drain(window=60.0)
    assert drain.rate(0.0) is None
    assert drain.retry_after(0, 0.0) == 5.0  # nothing to estimate from
    for t in (100.0, 102.0, 104.0, 106.0):
        drain.note(t)
    assert drain.rate(110.0) == pytest.approx(4 / 10)
    assert drain.rate(110.0) == pytest.approx(4 / 10)  # a read changes nothing
    assert drain.retry_after(1, 110.0) == pytest.approx(5.0)
    assert drain.retry_after(0, 100.5) == 1.0  # at least a second
    assert drain.retry_after(1000, 110.0) == 60.0  # at most a minute
    assert drain.rate(163.0) == pytest.approx(2 / 59)  # the first two left the window
    assert drain.rate(500.0) is None
    drain.note(500.0)
    assert drain.rate(500.0) == 1.0  # one release, over at least a second
