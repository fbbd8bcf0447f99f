"""Fair queueing between tenants: the virtual token counters, and the queue serving the tenant furthest behind."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable
from dataclasses import dataclass

import pytest

from gateway.admission.fairness import OUTPUT_WEIGHT, PROMPT_WEIGHT, FairShare
from gateway.admission.queue import WaitQueue


@dataclass(eq=False)  # the queue compares items by identity
class Req:
    tenant: str
    prompt: int = 100
    output: int = 0
    priority: int = 0
    weight: float = 1.0
    blocks: int = 1
    name: str = ""

    def __repr__(self) -> str:
        return self.name or self.tenant


def cost(r: Req) -> float:
    """What serving ``r`` adds to its tenant's counter."""
    return (r.prompt * PROMPT_WEIGHT + r.output * OUTPUT_WEIGHT) / r.weight


def fair_queue(bound: int = 8) -> WaitQueue[Req]:
    return WaitQueue(starvation_bound=bound, fair=True)


_clock = itertools.count()


def push(queue: WaitQueue[Req], reqs: Iterable[Req], timeout: float = 1e9) -> None:
    for r in reqs:
        now = float(next(_clock))
        queue.push(r, now, now + timeout)


def serve_one(queue: WaitQueue[Req]) -> Req | None:
    """Admit what the queue picks and run it to its end, as the controller does with room for one request."""
    r = queue.pick(lambda _: True)
    if r is not None:
        queue.remove(r)
        queue.served(r, prompt_tokens=r.prompt)
        queue.served(r, output_tokens=r.output)
    return r


def serve(queue: WaitQueue[Req], count: int) -> list[Req]:
    served = [serve_one(queue) for _ in range(count)]
    return [r for r in served if r is not None]


# -- the counters ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prompt", "output", "weight", "counter"),
    [
        (100, 0, 1.0, 100.0),
        (0, 50, 1.0, 100.0),  # an output token weighs two prompt tokens
        (100, 50, 2.0, 100.0),  # divided by the weight
        (30, 0, 4.0, 7.5),
    ],
)
def test_a_charge_adds_weighted_tokens_over_the_weight(prompt: int, output: int, weight: float, counter: float) -> None:
    shares = FairShare()
    shares.charge("a", weight, prompt_tokens=prompt, output_tokens=output)
    assert shares.counter("a") == counter and shares.weight("a") == weight
    assert shares.status() == {"a": {"weight": weight, "counter": counter}}


def test_a_weight_must_be_positive() -> None:
    with pytest.raises(ValueError, match="weight must be above 0; 'a' has 0"):
        FairShare().charge("a", 0.0, prompt_tokens=1)


@pytest.mark.parametrize(
    ("counters", "waiting", "last_idle", "lifted"),
    [
        ({"a": 0, "b": 500, "c": 300}, ["b", "c"], None, 300.0),  # to the smallest counter among those waiting
        ({"a": 800, "b": 500}, ["b"], None, 800.0),  # never lowered: service received stays counted
        ({"a": 0, "b": 400}, [], "b", 400.0),  # nobody waits: to the tenant that stopped waiting last
        ({"a": 0}, [], None, 0.0),  # the first tenant ever
    ],
)
def test_a_tenant_that_starts_waiting_is_lifted(
    counters: dict[str, int], waiting: list[str], last_idle: str | None, lifted: float
) -> None:
    shares = FairShare()
    for tenant, counter in counters.items():
        shares.charge(tenant, 1.0, prompt_tokens=counter)
    if last_idle is not None:
        shares.rest(last_idle)
    shares.wake("a", 1.0, waiting)
    assert shares.counter("a") == lifted


# -- the queue's order ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("weights", "served", "expected"),
    [
        ({"a": 1.0, "b": 1.0}, 8, {"a": 4, "b": 4}),
        ({"a": 3.0, "b": 1.0}, 40, {"a": 30, "b": 10}),
        ({"a": 2.0, "b": 1.0, "c": 1.0}, 40, {"a": 20, "b": 10, "c": 10}),
    ],
)
def test_competing_tenants_are_served_tokens_in_proportion_to_their_weights(
    weights: dict[str, float], served: int, expected: dict[str, int]
) -> None:
    queue = fair_queue()
    for tenant, weight in weights.items():
        push(queue, [Req(tenant, weight=weight) for _ in range(served)])
    order = serve(queue, served)
    assert {t: sum(r.prompt for r in order if r.tenant == t) for t in weights} == {
        t: n * 100 for t, n in expected.items()
    }


def test_two_tenants_of_equal_weight_take_turns() -> None:
    queue = fair_queue()
    push(queue, [Req("a") for _ in range(3)])
    push(queue, [Req("b") for _ in range(3)])
    assert [r.tenant for r in serve(queue, 6)] == ["a", "b", "a", "b", "a", "b"]


def test_a_tenant_alone_is_served_whatever_its_counter() -> None:
    queue = fair_queue()
    push(queue, [Req("a", prompt=10_000) for _ in range(5)])
    assert len(serve(queue, 5)) == 5 and len(queue) == 0


def test_a_tenant_back_from_idle_cannot_spend_saved_credit() -> None:
    queue = fair_queue()
    push(queue, [Req("a") for _ in range(20)])
    serve(queue, 10)  # "b" idle meanwhile: no credit builds up for it
    push(queue, [Req("b") for _ in range(5)])
    # Lifted to a's counter: the two alternate, b first as the one with fewer waiting.
    assert [r.tenant for r in serve(queue, 6)] == ["b", "a", "b", "a", "b", "a"]


def test_a_tenant_arriving_at_an_empty_queue_starts_where_the_last_one_stopped() -> None:
    queue = fair_queue()
    for _ in range(10):
        push(queue, [Req("a")])
        serve_one(queue)  # the engine has room: each request passes straight through
    push(queue, [Req("b") for _ in range(3)])
    push(queue, [Req("a") for _ in range(3)])
    assert queue.shares.counter("b") == queue.shares.counter("a") == 1000.0
    assert [r.tenant for r in serve(queue, 6)] == ["b", "a", "b", "a", "b", "a"]


def test_a_sparse_tenant_lifted_to_a_tie_goes_before_the_floods_next_request() -> None:
    queue = fair_queue()
    push(queue, [Req("flood") for _ in range(8)])
    serve(queue, 3)
    push(queue, [Req("quiet", prompt=10)])
    assert queue.shares.counter("quiet") == queue.shares.counter("flood")
    assert [r.tenant for r in serve(queue, 2)] == ["quiet", "flood"]


def test_priorities_order_a_tenants_requests_but_not_the_tenants() -> None:
    queue = fair_queue()
    push(queue, [Req("a", name="a-low"), Req("a", priority=5, name="a-high")])
    push(queue, [Req("b", priority=9, name="b-urgent"), Req("b", priority=9, name="b-urgent2")])
    assert [r.name for r in serve(queue, 4)] == ["a-high", "b-urgent", "a-low", "b-urgent2"]


def test_output_charged_at_the_end_counts_against_the_tenant() -> None:
    queue = fair_queue()
    push(queue, [Req("a", output=500), Req("a"), Req("a")])
    push(queue, [Req("b") for _ in range(3)])
    # a's first request cost 100 + 2 x 500: b is served until it has received as much.
    assert [r.tenant for r in serve(queue, 6)] == ["a", "b", "b", "b", "a", "a"]


def test_without_fair_queueing_the_counters_advance_but_priority_fifo_decides() -> None:
    queue: WaitQueue[Req] = WaitQueue(starvation_bound=8)
    push(queue, [Req("a", name=f"a{i}") for i in range(3)])
    push(queue, [Req("b", name="b0"), Req("b", priority=1, name="b-high")])
    assert [r.name for r in serve(queue, 5)] == ["b-high", "a0", "a1", "a2", "b0"]
    assert queue.tenants() == {
        "a": {"weight": 1.0, "counter": 300.0, "queued": 0}, "b": {"weight": 1.0, "counter": 200.0, "queued": 0},
    }


# -- the bounds that hold with or without fairness --------------------------------------------------
def test_the_starvation_bound_holds_across_tenants() -> None:
    queue = fair_queue(bound=2)
    big = Req("a", blocks=8, name="big")
    push(queue, [big])
    push(queue, [Req("b", blocks=1, name=f"small{i}") for i in range(3)])
    room = 1
    passed = []
    for _ in range(3):
        r = queue.pick(lambda item: item.blocks <= room)
        if r is None:
            break
        passed.append(r.name)
        queue.remove(r)
    assert passed == ["small0", "small1"]  # then the head goes first
    room = 8
    assert queue.pick(lambda item: item.blocks <= room) is big


def test_deadlines_expire_in_every_tenants_lane() -> None:
    queue = fair_queue()
    a_early, b_late, b_early = Req("a", name="a-early"), Req("b", name="b-late"), Req("b", priority=1, name="b-early")
    queue.push(a_early, 0.0, 10.0)
    queue.push(b_late, 1.0, 30.0)
    queue.push(b_early, 2.0, 12.0)
    assert queue.nearest_deadline() == 10.0
    assert queue.expired(9.0) == []
    assert sorted(r.name for r in queue.expired(12.0)) == ["a-early", "b-early"]
    for r in (a_early, b_early):
        queue.remove(r)
    assert queue.nearest_deadline() == 30.0 and queue.depth_by_tenant == {"b": 1}


def test_the_position_counts_the_turns_of_the_other_tenants() -> None:
    queue = fair_queue()
    push(queue, [Req("a", weight=3.0) for _ in range(4)])
    b = [Req("b") for _ in range(2)]
    push(queue, b)
    # b's second request: one of b's ahead; "a" takes three turns to each of b's.
    assert queue.position(b[1]) == 7 and queue.position(b[0]) == 3


# -- property: backlogged tenants' shares follow their weights ------------------------------------------
def random_request(rng: random.Random, tenant: str, weight: float) -> Req:
    return Req(tenant, prompt=rng.randint(1, 400), output=rng.randint(0, 200), priority=rng.randint(0, 2),
               weight=weight)


LARGEST = (400 * PROMPT_WEIGHT + 200 * OUTPUT_WEIGHT)  # the largest request's weighted tokens


@pytest.mark.parametrize("seed", range(12))
def test_tenants_backlogged_together_receive_their_weighted_share_within_one_request(seed: int) -> None:
    rng = random.Random(seed)
    weights = {t: float(rng.randint(1, 4)) for t in "abc"[: rng.randint(2, 3)]}
    one_request = LARGEST / min(weights.values())
    queue = fair_queue()
    for tenant, weight in weights.items():  # everyone waiting from the start, and never running dry
        push(queue, [random_request(rng, tenant, weight) for _ in range(150)])
    received = dict.fromkeys(weights, 0.0)  # weighted tokens served, per unit of weight
    for _ in range(200):
        for tenant, weight in weights.items():
            if rng.random() < 0.3:
                push(queue, [random_request(rng, tenant, weight)])
        r = serve_one(queue)
        assert r is not None
        received[r.tenant] += cost(r)
        assert max(received.values()) - min(received.values()) <= one_request


@pytest.mark.parametrize("seed", range(12))
def test_with_tenants_coming_and_going_no_one_falls_behind_by_more_than_one_request(seed: int) -> None:
    """Sparse random arrivals: tenants go idle and come back. Among those waiting the counters stay within one
    request's charge, so over any stretch two tenants both wait they receive their shares within two."""
    rng = random.Random(1000 + seed)
    weights = {t: float(rng.randint(1, 4)) for t in "abcd"}
    rates = {t: rng.uniform(0.02, 0.6) for t in weights}  # arrivals per request served: some flood, some trickle
    one_request = LARGEST / min(weights.values())
    queue = fair_queue()
    received = dict.fromkeys(weights, 0.0)
    since: dict[tuple[str, str], tuple[float, float]] = {}  # pairs waiting together: what each had received then
    for _ in range(600):
        for tenant, weight in weights.items():
            if rng.random() < rates[tenant]:
                push(queue, [random_request(rng, tenant, weight)])
        waiting = set(queue.depth_by_tenant)
        counters = [queue.shares.counter(t) for t in waiting]
        assert not counters or max(counters) - min(counters) <= one_request
        since = {
            (f, g): since.get((f, g), (received[f], received[g]))
            for f, g in itertools.permutations(sorted(waiting), 2)
        }
        r = serve_one(queue)
        if r is not None:
            received[r.tenant] += cost(r)
        still = set(queue.depth_by_tenant)  # a tenant that ran dry starts over when it comes back
        since = {pair: start for pair, start in since.items() if still.issuperset(pair)}
        for (f, g), (f0, g0) in since.items():
            assert abs((received[f] - f0) - (received[g] - g0)) <= 2 * one_request
