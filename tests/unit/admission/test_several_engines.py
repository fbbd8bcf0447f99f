"""Admission over several engines serving one model: each engine has its own budget and books, the queue is one. A
request goes to an engine with room (the one holding its prompt's prefix first), waits only while none has room,
and is refused only when it exceeds the largest engine's budget, whatever the engines hold together."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from gateway import errors
from gateway.admission import Admission, Reservation
from gateway.admission.prefix import PromptPrefix
from gateway.config import Settings
from gateway.engine.live import EngineView
from gateway.metrics import Metrics
from tests.support.clock import FakeClock, ManualSleep
from tests.unit.admission.rig import BS, Upstream, enter, settle, vllm_text

PREFIX = list(range(3, 163))  # 160 tokens: 10 full blocks of 16


class Engines:
    """An Admission over scripted engines of ``blocks`` blocks each, on a fake clock; ``usable`` lists the engines
    that may take requests (up and not hung)."""

    def __init__(self, *blocks: int, **flags: Any) -> None:
        flags.setdefault("queue_timeout", 30.0)  # the waits of these tests: a queue timeout of 30 s
        flags.setdefault("kv_target", 1.0)
        flags.setdefault("admission_policy", "strict")
        flags.setdefault("prefix_sharing", "off")
        self.settings = Settings(**flags)
        self.clock = FakeClock()
        self.sleep = ManualSleep()
        self.metrics = Metrics()
        self.blocks = list(blocks)
        self.upstreams = [Upstream() for _ in blocks]
        self.views = [
            # The first engine's view reports into the gateway's metrics, the others into their own (as assembled).
            EngineView(up, interval=0.25, stale_after=2.0, metrics=self.metrics if i == 0 else Metrics(),
                       clock=self.clock, sleep=self.sleep)
            for i, up in enumerate(self.upstreams)
        ]
        self.usable = set(range(len(blocks)))
        self.adm = Admission(self.settings, self.views[0], self.metrics, self.clock, sleep=self.sleep,
                             engines=self.views, usable=lambda i: i in self.usable)
        self._ids = 0

    async def scrape(self) -> None:
        for count, up, view in zip(self.blocks, self.upstreams, self.views, strict=True):
            up.text = vllm_text(0.0, blocks=count)
            await view.refresh()

    async def page(self, engine: int, text: str) -> None:
        self.upstreams[engine].text = text
        await self.views[engine].refresh()

    def req(
        self, blocks: int, *, prefix: PromptPrefix | None = None, avoid: frozenset[str] = frozenset()
    ) -> Reservation:
        """A request needing ``blocks`` blocks (its own, with a prefix: the prefix's 10 and its last block)."""
        self._ids += 1
        prompt = len(prefix.ids) if prefix is not None else 8
        return self.adm.reservation(prompt_tokens=prompt, max_tokens=blocks * BS - prompt, n=1, priority=0,
                                    request_id=f"r{self._ids}", prefix=prefix, avoid=avoid)

    async def admitted(self, blocks: int, **kw: Any) -> Reservation:
        return await self.req(blocks, **kw).__aenter__()

    def rows(self, key: str) -> dict[str, Any]:
        return {row["name"]: row[key] for row in self.adm.status()["engines"]}

    def gauge(self, name: str, engine: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, {"engine": engine})

    def assert_drained(self) -> None:
        assert (self.adm.committed, self.adm.in_flight, self.adm.queued) == (0, 0, 0)
        assert set(self.rows("committed_blocks").values()) == {0}
        assert set(self.rows("in_flight").values()) == {0}


async def engines(*blocks: int, **flags: Any) -> Engines:
    pool = Engines(*blocks, **flags)
    await pool.scrape()
    return pool


def prompt(tail: int) -> PromptPrefix:
    """161 tokens: the common 160-token prefix, and a last token of its own."""
    return PromptPrefix([*PREFIX, 400 + tail], "m\0")


def target(r: Reservation) -> str | None:
    return r.target.name if r.target is not None else None


# -- placing and queueing ---------------------------------------------------------------------------
async def test_a_request_goes_to_the_second_engine_when_the_first_is_full() -> None:
    pool = await engines(12, 10)
    first = await pool.admitted(10)
    second = await pool.admitted(6)
    assert (target(first), target(second)) == ("0", "1")
    assert pool.rows("committed_blocks") == {"0": 10, "1": 6}
    third = pool.req(6)
    waiting = enter(third)
    await settle()
    assert not waiting.done() and pool.adm.queued == 1  # 2 blocks left on one, 4 on the other: neither takes 6
    second.release()
    await waiting
    assert target(third) == "1" and pool.rows("committed_blocks") == {"0": 10, "1": 6}
    for r in (first, third):
        r.release()
    pool.assert_drained()


@pytest.mark.parametrize("freed", ["0", "1"])
async def test_a_queued_request_goes_to_whichever_engine_frees_room_first(freed: str) -> None:
    pool = await engines(10, 10)
    holders = {target(r): r for r in [await pool.admitted(10), await pool.admitted(10)]}
    waiter = pool.req(8)
    waiting = enter(waiter)
    await settle()
    assert pool.adm.queued == 1 and set(holders) == {"0", "1"}
    holders.pop(freed).release()
    await waiting
    assert target(waiter) == freed
    other = "1" if freed == "0" else "0"
    assert pool.rows("committed_blocks") == {freed: 8, other: 10}
    for r in (waiter, *holders.values()):
        r.release()
    pool.assert_drained()


async def test_a_release_frees_the_books_of_the_engine_it_was_placed_on() -> None:
    pool = await engines(10, 10)
    on_0, on_1 = await pool.admitted(7), await pool.admitted(5)
    assert (target(on_0), target(on_1)) == ("0", "1")
    on_1.release()
    assert pool.rows("committed_blocks") == {"0": 7, "1": 0}
    assert pool.rows("in_flight") == {"0": 1, "1": 0}
    assert pool.rows("admitted_total") == {"0": 1, "1": 1}
    on_0.release()
    pool.assert_drained()


async def test_a_request_waits_rather_than_go_to_an_engine_that_cannot_take_it() -> None:
    pool = await engines(10, 10)
    pool.usable = {1}
    first = await pool.admitted(8)
    second = pool.req(8)
    waiting = enter(second)
    await settle()
    assert target(first) == "1" and not waiting.done()  # engine 0 has room, but is down
    pool.usable = {0, 1}
    pool.adm.tick()
    await waiting
    assert target(second) == "0"
    for r in (first, second):
        r.release()
    pool.assert_drained()


async def test_with_no_engine_usable_a_queued_request_waits_for_one_rather_than_go_into_one() -> None:
    """What /health says, admission follows: nothing is sent into an engine seen down or hung, even the last one
    (new requests are refused by the request path meanwhile; one queued before waits, within its deadline)."""
    pool = await engines(10, 12)
    pool.usable = set()
    r = pool.req(4)
    waiting = enter(r)
    await settle()
    assert not waiting.done()
    pool.usable = {0}
    pool.adm.tick()
    await waiting
    assert target(r) == "0"
    r.release()
    pool.assert_drained()


async def test_a_request_avoids_the_engine_it_failed_on() -> None:
    pool = await engines(20, 10)
    r = await pool.admitted(4, avoid=frozenset({"0"}))
    assert target(r) == "1"
    r.release()
    pool.assert_drained()


# -- budgets --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kv_target", "budgets"), [(1.0, {"0": 10, "1": 30}), (0.5, {"0": 5, "1": 15})], ids=["whole", "half"]
)
async def test_the_budget_and_status_are_every_engines_together(kv_target: float, budgets: dict[str, int]) -> None:
    pool = await engines(10, 30, kv_target=kv_target)
    held = [await pool.admitted(4), await pool.admitted(3)]
    status = pool.adm.status()
    assert pool.adm.budget_blocks() == status["budget_blocks"] == sum(budgets.values())
    assert status["capacity_blocks"] == 40
    assert pool.rows("budget_blocks") == budgets and pool.rows("capacity_blocks") == {"0": 10, "1": 30}
    assert status["committed_blocks"] == pool.adm.committed == 7 == sum(pool.rows("committed_blocks").values())
    assert status["in_flight"] == 2
    pool.adm.publish()
    assert {e: pool.gauge("vllm_guard_engine_budget_blocks", e) for e in budgets} == budgets
    assert sum(pool.gauge("vllm_guard_engine_committed_blocks", e) or 0 for e in budgets) == 7
    assert sum(pool.gauge("vllm_guard_engine_in_flight_requests", e) or 0 for e in budgets) == 2
    assert sum(pool.gauge("vllm_guard_engine_admitted_requests", e) or 0 for e in budgets) == 2
    assert pool.metrics.registry.get_sample_value("vllm_guard_kv_budget_blocks") == sum(budgets.values())
    for r in held:
        r.release()
    pool.assert_drained()


async def test_a_request_larger_than_the_largest_engine_is_refused_though_the_engines_together_would_hold_it() -> None:
    pool = await engines(10, 10)
    with pytest.raises(errors.KVBudgetExceeded, match=r"needs 15 KV blocks.*budget of 10 blocks"):
        await pool.admitted(15)
    with pytest.raises(errors.KVBudgetExceeded):
        pool.adm.fit(8, 15 * BS - 8, 1, clamp=False)
    assert pool.adm.fit(8, 15 * BS - 8, 1, clamp=True) == 10 * BS - 8  # clamped to the largest engine
    whole = await pool.admitted(10)  # the largest engine's whole budget still fits
    whole.release()
    pool.assert_drained()


# -- prefix affinity --------------------------------------------------------------------------------
async def test_a_request_sharing_a_held_prefix_goes_to_the_engine_that_holds_it() -> None:
    pool = await engines(40, 40, prefix_sharing="on")
    filler = await pool.admitted(5)  # engine 0: 35 free, so the first prompt goes to engine 1
    holder = await pool.admitted(11, prefix=prompt(1))
    assert (target(filler), target(holder)) == ("0", "1")
    sharer = await pool.admitted(11, prefix=prompt(2))
    assert target(sharer) == "1" and sharer.blocks == 1  # 29 free there against 35, but the prefix is held
    stranger = await pool.admitted(11)
    assert target(stranger) == "0"  # no prefix: the most room
    for r in (holder, sharer, stranger):
        r.release()
    busy = await pool.admitted(12)  # engine 1 (40 free against 35) now has the least room
    assert target(busy) == "1"
    returning = await pool.admitted(11, prefix=prompt(3))
    assert target(returning) == "1"  # it finished that prefix lately: vLLM still caches it there
    for r in (filler, busy, returning):
        r.release()
    pool.assert_drained()


async def test_placement_by_headroom_alone_ignores_the_held_prefix() -> None:
    pool = await engines(40, 40, prefix_sharing="on", placement="headroom")
    filler = await pool.admitted(5)
    holder = await pool.admitted(11, prefix=prompt(1))
    sharer = await pool.admitted(11, prefix=prompt(2))
    assert (target(filler), target(holder), target(sharer)) == ("0", "1", "0")  # 35 free on 0 against 29 on 1
    assert sharer.blocks == 11  # nothing of its prompt is held where it went
    for r in (filler, holder, sharer):
        r.release()
    pool.assert_drained()

# -- data-parallel ranks ----------------------------------------------------------------------------
def two_ranks(blocks: int) -> str:
    """A data-parallel engine's page: two ranks of ``blocks`` blocks each, under their ``engine`` labels (vLLM
    labels every engine with the engines' summed blocks and its own tokens)."""
    return "".join(
        f'vllm:kv_cache_usage_perc{{engine="{rank}"}} 0.0\n'
        f'vllm:cache_config_info{{block_size="{BS}",engine="{rank}",kv_cache_size_tokens="{(blocks + 1) * BS}",'
        f'num_gpu_blocks="{2 * (blocks + 1)}"}} 1.0\n'
        for rank in (0, 1)
    )


async def test_a_data_parallel_engine_is_booked_rank_by_rank_once_idle() -> None:
    pool = await engines(10, 10)
    running = await pool.admitted(4)
    assert target(running) == "0"
    await pool.page(0, two_ranks(8))
    assert list(pool.rows("name")) == ["0", "1"]  # a request runs on it: split once it ends
    running.release()
    await pool.page(0, two_ranks(8))
    assert list(pool.rows("name")) == ["0.0", "0.1", "1"]
    assert pool.rows("budget_blocks") == {"0.0": 8, "0.1": 8, "1": 10} and pool.adm.budget_blocks() == 26
    placed = [await pool.admitted(7) for _ in range(3)]
    assert [(target(r), r.target.rank if r.target else None) for r in placed] == [("1", None), ("0.0", 0), ("0.1", 1)]
    with pytest.raises(errors.KVBudgetExceeded):  # more than the largest site's 10 blocks, though 26 are budgeted
        await pool.admitted(11)
    for r in placed:
        r.release()
    pool.assert_drained()


# -- invariants -----------------------------------------------------------------------------------
class Traffic:
    """Random arrivals, releases, withdrawals and engines going down and up, over one pool."""

    def __init__(self, pool: Engines, rng: random.Random) -> None:
        self.pool = pool
        self.rng = rng
        self.entering: list[tuple[Reservation, asyncio.Task[Reservation]]] = []

    def arrive(self) -> None:
        largest = max(self.pool.blocks)
        blocks = self.rng.randint(1, largest + 2)  # now and then more than any engine holds: refused
        prefix = prompt(self.rng.randrange(4)) if self.rng.random() < 0.5 and blocks >= 11 else None
        r = self.pool.req(blocks, prefix=prefix)
        self.entering.append((r, enter(r)))

    def step(self) -> None:
        roll = self.rng.random()
        admitted = [r for r, _ in self.entering if r.admitted]
        queued = [(r, t) for r, t in self.entering if not t.done()]
        if roll < 0.45:
            self.arrive()
        elif roll < 0.8 and admitted:
            self.rng.choice(admitted).release()
        elif roll < 0.9 and queued:
            self.rng.choice(queued)[1].cancel()
        else:
            self.pool.usable = {i for i in range(len(self.pool.blocks)) if self.rng.random() < 0.7}
            self.pool.adm.tick()

    def check(self) -> None:
        rows = self.pool.adm.status()["engines"]
        for row in rows:
            assert row["committed_blocks"] <= row["budget_blocks"], row
        assert sum(row["committed_blocks"] for row in rows) == self.pool.adm.committed
        assert sum(row["in_flight"] for row in rows) == self.pool.adm.in_flight

    async def drain(self) -> None:
        for r, task in self.entering:
            r.release()
            if not task.done():
                task.cancel()
        await asyncio.gather(*(task for _, task in self.entering), return_exceptions=True)
        await settle()


@pytest.mark.parametrize("sharing", ["on", "off"])
@pytest.mark.parametrize("seed", range(12))
async def test_under_strict_no_engine_is_ever_booked_past_its_budget_and_everything_drains(
    seed: int, sharing: str
) -> None:
    rng = random.Random(seed)
    blocks = [rng.randint(12, 40) for _ in range(rng.choice((2, 3)))]
    pool = await engines(*blocks, prefix_sharing=sharing)
    traffic = Traffic(pool, rng)
    for _ in range(300):
        traffic.step()
        await settle()
        traffic.check()
    placed = {target(r) for r, _ in traffic.entering if r.target is not None}
    assert len(placed) >= 2, placed  # the traffic did spread
    assert any(r.waited and r.target is not None for r, _ in traffic.entering)  # and filled engines
    await traffic.drain()
    for _, task in traffic.entering:
        assert task.cancelled() or task.exception() is None or isinstance(task.exception(), errors.GatewayError)
    pool.assert_drained()
