"""Random traffic with shared and unshared prefixes, ``n > 1``, cancellations and releases, under strict admission
with prefix sharing: at every step the committed blocks are never fewer than what the engine must hold for the
gateway's requests at their full size, the budget is never passed, and everything drains to zero.

What the engine must hold is computed here from the token ids alone, independently of the ledger's keys: one block
for each distinct shareable prompt block (its tokens and everything before them, under the same salt) among the
admitted requests, as vLLM's prefix cache holds it, plus each sequence's own blocks (the block with the last prompt
token on, to its full ``max_tokens``)."""

from __future__ import annotations

import asyncio
import random

import pytest

from gateway import errors
from gateway.admission import Reservation
from gateway.admission.ledger import blocks_for
from gateway.admission.prefix import PromptPrefix
from tests.unit.admission.rig import BS, Rig, enter
from tests.unit.admission.test_invariants import Traffic

CAPACITY = 96
STEPS = 250
EXPECTED_FAILURES = (errors.QueueFull, errors.QueueTimeout, errors.KVBudgetExceeded, asyncio.CancelledError)


def engine_must_hold(admitted: list[Reservation]) -> int:
    """Blocks vLLM holds for ``admitted`` at their full size, with prefix caching, computed from the ids."""
    shared: set[tuple[str, tuple[int, ...]]] = set()
    own = 0
    for r in admitted:
        assert r.prefix is not None
        ids, salt = list(r.prefix.ids), r.prefix.salt
        shareable = (len(ids) - 1) // BS
        shared.update((salt, tuple(ids[: (j + 1) * BS])) for j in range(shareable))
        own += r.n * (blocks_for(len(ids) + r.max_tokens, BS) - shareable)
    return len(shared) + own


class SharedTraffic(Traffic):
    """The invariant test's traffic, with prompts drawn from four prefix families (and none) under four salts."""

    def __init__(self, rig: Rig, rng: random.Random) -> None:
        super().__init__(rig, rng, engine=False)
        self.families = [[rng.randrange(3, 500) for _ in range(rng.choice([40, 100, 200]))] for _ in range(4)]
        self.peak_logical_over_physical = 0.0

    def reserve(self) -> None:
        rng = self.rng
        family = rng.choice([*self.families, []])  # one arrival in five shares nothing
        cut = rng.randint(0, len(family))
        ids = family[:cut] + [rng.randrange(3, 500) for _ in range(rng.randint(1, 40))]
        salt = rng.choice(["m\0", "m\0", "m\0", "lora\0", "m\0tenant"])
        r = self.rig.adm.reservation(
            prompt_tokens=len(ids), max_tokens=rng.randint(1, 120), n=rng.choice([1, 1, 2, 4]),
            priority=rng.randint(0, 2), request_id=f"r{self.steps}", prefix=PromptPrefix(ids, salt),
        )
        self.entered.append((r, enter(r)))

    def check(self) -> None:
        adm = self.rig.adm
        admitted = [r for r, _ in self.entered if r.admitted]
        must = engine_must_hold(admitted)
        assert must <= adm.committed <= CAPACITY
        assert adm.committed == must  # booked exactly: no block counted twice, none left out
        logical = sum(r.logical_blocks for r in admitted)
        assert adm.status()["prefix_sharing"]["logical_committed_blocks"] == logical >= adm.committed
        if adm.committed:
            self.peak_logical_over_physical = max(self.peak_logical_over_physical, logical / adm.committed)
        for _, task in self.entered:
            if task.done() and not task.cancelled() and task.exception() is not None:
                assert isinstance(task.exception(), EXPECTED_FAILURES)

    async def finish(self) -> None:
        await super().finish()
        assert self.rig.adm.status()["prefix_sharing"]["shared_blocks_held"] == 0


@pytest.mark.parametrize("seed", range(16))
async def test_strict_with_sharing_books_at_least_what_the_engine_holds_and_drains(seed: int) -> None:
    rig = Rig(kv_blocks=CAPACITY, block_size=BS, admission_policy="strict", prefix_sharing="on", max_queue=8,
              queue_timeout=5.0, starvation_bound=2)
    traffic = SharedTraffic(rig, random.Random(seed))
    for _ in range(STEPS):
        await traffic.step()
    assert traffic.peak_logical_over_physical > 1.1  # sharing happened
    await traffic.finish()
