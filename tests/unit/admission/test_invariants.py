"""Random traffic against the ledger and the queue: whatever the order of arrivals, releases, cancellations and
expiries, the ledger matches the admitted requests, never passes the budget, and returns to zero."""

from __future__ import annotations

import asyncio
import random

import pytest

from gateway import errors
from gateway.admission import Reservation
from gateway.admission.reservation import Phase
from tests.unit.admission.rig import Rig, enter, settle

CAPACITY, TARGET = 64, 0.75
BUDGET = 48  # floor(0.75 x 64)
STEPS = 200
EXPECTED_FAILURES = (errors.QueueFull, errors.QueueTimeout, errors.KVBudgetExceeded, asyncio.CancelledError)


class Traffic:
    """Seeded random operations on one rig, with the invariants checked after each."""

    def __init__(self, rig: Rig, rng: random.Random, *, engine: bool) -> None:
        self.rig = rig
        self.rng = rng
        self.engine = engine
        self.entered: list[tuple[Reservation, asyncio.Task[Reservation]]] = []
        self.preemptions = 0.0
        self.steps = 0
        self.peak_committed = 0
        self.peak_queued = 0

    def reserve(self) -> None:
        r = self.rig.req(self.rng.randint(1, 30), priority=self.rng.randint(0, 2), n=self.rng.choice([1, 1, 2]))
        self.entered.append((r, enter(r)))

    def release(self) -> None:
        live = [r for r, _ in self.entered if r.phase in (Phase.QUEUED, Phase.ADMITTED)]
        if live:
            self.rng.choice(live).release(completed=self.rng.random() < 0.7)

    def cancel(self) -> None:
        pending = [t for _, t in self.entered if not t.done()]
        if pending:
            self.rng.choice(pending).cancel()

    def progress(self) -> None:
        for r, _ in self.entered:
            if r.admitted:
                r.observe_output_tokens(r.generated + self.rng.randint(0, 16))

    async def time_passes(self) -> None:
        self.rig.clock.now += self.rng.uniform(0.0, 3.0)
        self.rig.adm.tick()
        if self.engine and self.rng.random() < 0.8:
            self.preemptions += self.rng.choice([0.0, 0.0, 1.0])
            await self.rig.scrape(self.rng.random() * 0.6, self.preemptions, blocks=CAPACITY)

    async def step(self) -> None:
        op = self.rng.choices(["reserve", "release", "cancel", "progress", "time"], weights=[6, 4, 1, 2, 2])[0]
        if op == "time":
            await self.time_passes()
        else:
            getattr(self, op)()
        await settle()
        self.steps += 1
        self.check()

    def check(self) -> None:
        adm = self.rig.adm
        admitted = [r for r, _ in self.entered if r.admitted]
        queued = [r for r, _ in self.entered if r.phase is Phase.QUEUED]
        assert adm.committed == sum(r.blocks for r in admitted) <= BUDGET
        assert (adm.in_flight, adm.queued) == (len(admitted), len(queued))
        self.peak_committed = max(self.peak_committed, adm.committed)
        self.peak_queued = max(self.peak_queued, adm.queued)
        if self.steps % 10 == 0:  # reading the registry is slow; the gauges are checked every few steps
            assert self.rig.count("vllm_guard_kv_committed_blocks") == adm.committed
            depth = sum(self.rig.count("vllm_guard_queue_depth", priority=str(p)) for p in range(3))
            assert depth == adm.queued
        for r, task in self.entered:
            if task.done() and not task.cancelled() and task.exception() is not None:
                assert isinstance(task.exception(), EXPECTED_FAILURES)
                assert r.phase in (Phase.REJECTED, Phase.RELEASED)

    async def finish(self) -> None:
        for r, task in self.entered:
            r.release()
            if not task.done():
                task.cancel()
        await asyncio.gather(*(t for _, t in self.entered), return_exceptions=True)
        await self.rig.adm.close()
        self.rig.assert_drained()
        assert self.rig.count("vllm_guard_kv_committed_blocks") == 0
        assert all(r.phase in (Phase.RELEASED, Phase.REJECTED) for r, _ in self.entered)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize(
    ("policy", "engine"),
    [("strict", False), ("strict", True), ("adaptive", False)],  # adaptive without live metrics is the ledger
)
async def test_random_traffic_never_overcommits_and_always_drains(seed: int, policy: str, engine: bool) -> None:
    flags = {"admission_policy": policy, "kv_target": TARGET, "max_queue": 6, "queue_timeout": 5.0,
             "starvation_bound": 2}
    rig = Rig(engine=engine, **flags) if engine else Rig(kv_blocks=CAPACITY, **flags)
    traffic = Traffic(rig, random.Random(seed), engine=engine)
    if engine:
        await rig.scrape(0.0, blocks=CAPACITY)
    for _ in range(STEPS):
        await traffic.step()
    assert traffic.peak_committed > BUDGET // 2 and traffic.peak_queued > 0  # the budget and the queue were used
    await traffic.finish()
