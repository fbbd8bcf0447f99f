"""The order that cuts waiting: under the default policy the request with the least expected work goes first within
a priority, aged so that none is passed by a request that arrived more than its bounded shift after it; strict
keeps arrival order."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from gateway.admission.order import MAX_SHIFT_SECONDS, SECONDS_PER_TOKEN, expected_work, shift
from gateway.admission.queue import WaitQueue
from tests.unit.admission.rig import Rig, enter, release_all, settle


@pytest.mark.parametrize(
    ("prompt", "cached", "output", "n", "work"),
    [(100, 0, 50, 1, 150), (100, 64, 50, 1, 86), (100, 200, 50, 2, 100), (0, 0, 0, 1, 0)],
)
def test_expected_work_is_the_uncached_prompt_and_the_expected_output_of_each_sequence(
    prompt: int, cached: int, output: int, n: int, work: int
) -> None:
    assert expected_work(prompt, cached, output, n) == work


@pytest.mark.parametrize(
    ("work", "limit", "seconds"),
    [(0, 30.0, 0.0), (1000, 30.0, 1000 * SECONDS_PER_TOKEN), (10**6, 30.0, MAX_SHIFT_SECONDS), (10**6, 2.0, 0.5)],
)
def test_the_shift_grows_with_work_up_to_its_bounds(work: int, limit: float, seconds: float) -> None:
    assert shift(work, limit) == pytest.approx(seconds)


@pytest.mark.parametrize(("policy", "first"), [("adaptive", "short"), ("strict", "long")])
async def test_the_default_policy_admits_the_shorter_of_two_waiting_requests_first(policy: str, first: str) -> None:
    rig = Rig(admission_policy=policy, kv_blocks=10)
    holder = await rig.req(10).__aenter__()
    # The same 6 blocks (only one fits at a time): 60 prompt tokens and 16 expected (a quarter of 36, at least
    # 16), against 8 and 22 (a quarter of 88).
    long, short = rig.req(6, prompt=60), rig.req(6, prompt=8)
    tasks = [enter(long), enter(short)]
    await settle()
    holder.release()
    await settle()
    admitted = {"long": long.admitted, "short": short.admitted}
    assert admitted == {"long": first == "long", "short": first == "short"}
    await release_all(rig, [long, short], tasks)


@dataclass(eq=False)
class Item:
    arrival: float
    shift: float
    priority: int = 0
    blocks: int = 1
    tenant: str = "default"
    weight: float = 1.0


@pytest.mark.parametrize("seed", range(20))
def test_no_request_is_passed_by_one_that_arrived_more_than_the_longest_shift_after_it(seed: int) -> None:
    rng = random.Random(seed)
    queue: WaitQueue[Item] = WaitQueue(starvation_bound=8)
    now, items = 0.0, []
    for _ in range(200):
        now += rng.expovariate(20.0)
        item = Item(now, shift(rng.randint(0, 8000), rng.choice([1.0, 5.0, 30.0])), rng.randint(0, 1))
        queue.push(item, now, now + 30.0, item.shift)
        items.append(item)
    served = []
    while (head := queue.head()) is not None:
        queue.remove(head)
        served.append(head)
    for i, a in enumerate(served):
        for b in served[i + 1:]:
            assert a.priority > b.priority or b.arrival + MAX_SHIFT_SECONDS >= a.arrival  # never long passed
            if a.priority == b.priority:
                assert a.arrival + a.shift <= b.arrival + b.shift
