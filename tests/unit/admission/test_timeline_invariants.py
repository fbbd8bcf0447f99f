"""Random arrivals with random progress under strict with time-aware booking, against an engine that steps the way
vLLM's scheduler does: after every step the blocks the engine holds for the gateway's requests never exceed the
budget, and everything drains to zero.

The engine here: a request joins ``waiting`` some steps after its admission (the HTTP hop) as its ``n`` sequences;
each step the running sequences are scheduled in the order they joined while the token budget lasts (now and then
it runs out part-way, and the rest of ``running`` and every waiting sequence stall that step), then the waiting ones
join at the end of ``running``. A sequence's prefill may be cut into chunks; each decode step allocates slots for
``prompt + tokens so far`` and samples one token; it ends at ``max_tokens`` or earlier (a stop). What it holds is
computed from the ids alone: its own blocks, and each distinct shareable prompt block once among the running
sequences. The gateway sees each stream's count late (a random lag of steps), with up to ``PROGRESS_SLACK``
tokenless events per sequence on top, or only at the end (not streamed), and releases some steps after the end."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import pytest

from gateway import errors
from gateway.admission import Reservation
from gateway.admission.ledger import blocks_for
from gateway.admission.prefix import PromptPrefix
from gateway.admission.timeline import PROGRESS_SLACK
from tests.unit.admission.rig import BS, Rig, enter, settle

CAPACITY = 32
STEPS = 400


@dataclass
class Sequence:
    ids: list[int]
    salt: str
    stop_at: int  # tokens it samples before it ends (max_tokens, or fewer: a stop)
    chunk: int  # prompt tokens computed per prefill step
    computed: int = 0
    produced: int = 0
    allocated: int = 0  # tokens with slots

    def advance(self) -> None:
        prompt = len(self.ids)
        if self.computed < prompt:
            self.computed = self.allocated = min(prompt, self.computed + self.chunk)
            self.produced = 1 if self.computed == prompt else 0
        else:
            self.allocated = prompt + self.produced
            self.produced += 1

    @property
    def done(self) -> bool:
        return self.produced >= self.stop_at


@dataclass
class Flight:
    """One admitted request: its sequences in the engine, and what the gateway saw of them."""

    r: Reservation
    streamed: bool
    joins_at: int
    seqs: list[Sequence]
    history: list[int] = field(default_factory=list)  # tokens made, after each step
    release_at: int | None = None


class SteppingEngine:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []

    def step(self) -> int:
        """Run one step; returns the blocks held during it."""
        budget_lasts = self.rng.random() > 0.25
        scheduled = len(self.running) if budget_lasts else self.rng.randint(0, len(self.running))
        for seq in self.running[:scheduled]:
            seq.advance()
        if budget_lasts:
            for seq in self.waiting:
                seq.advance()
            self.running += self.waiting
            self.waiting = []
        held = self.held()
        self.running = [s for s in self.running if not s.done]
        return held

    def held(self) -> int:
        keys: set[tuple[str, tuple[int, ...]]] = set()
        own = 0
        for seq in self.running:
            shareable = (len(seq.ids) - 1) // BS
            blocks = blocks_for(seq.allocated, BS)
            keys.update((seq.salt, tuple(seq.ids[: (j + 1) * BS])) for j in range(min(shareable, blocks)))
            own += max(0, blocks - shareable)
        return len(keys) + own


class TimedTraffic:
    def __init__(self, rig: Rig, rng: random.Random) -> None:
        self.rig, self.rng = rig, rng
        self.engine = SteppingEngine(rng)
        self.families = [[rng.randrange(3, 500) for _ in range(rng.choice([40, 90]))] for _ in range(3)]
        self.entered: list[tuple[Reservation, asyncio.Task[Reservation]]] = []
        self.flights: dict[Reservation, Flight] = {}
        self.step_no = 0
        self.peak_held = 0
        self.peak_over_books = 0  # how far the books went past the budget: what time-aware admitted beyond strict

    def arrive(self) -> None:
        rng = self.rng
        family = rng.choice([*self.families, []])
        ids = family[: rng.randint(0, len(family))] + [rng.randrange(3, 500) for _ in range(rng.randint(1, 40))]
        r = self.rig.adm.reservation(
            prompt_tokens=len(ids), max_tokens=rng.choice([rng.randint(1, 8), rng.randint(60, 160)]),
            n=rng.choice([1, 1, 1, 2]),
            priority=rng.randint(0, 1), request_id=f"r{self.step_no}", prefix=PromptPrefix(ids, rng.choice("ab")),
        )
        self.entered.append((r, enter(r)))

    def board(self) -> None:
        """Requests admitted since the last step head for the engine."""
        rng = self.rng
        for r, _ in self.entered:
            if r.admitted and r not in self.flights:
                assert r.prefix is not None
                ids, salt = list(r.prefix.ids), r.prefix.salt
                stop = r.max_tokens if rng.random() < 0.9 else rng.randint(1, r.max_tokens)
                seqs = [Sequence(ids, salt, stop,
                                 rng.choice([len(ids), 16, 7])) for _ in range(r.n)]
                self.flights[r] = Flight(r, rng.random() < 0.9, self.step_no + rng.randint(0, 3), seqs)

    def run_engine(self) -> None:
        for f in self.flights.values():
            if f.joins_at == self.step_no:
                self.engine.waiting += f.seqs
        held = self.engine.step()
        assert held <= CAPACITY, f"the engine holds {held} blocks, over the budget of {CAPACITY}"
        self.peak_held = max(self.peak_held, held)

    def observe(self) -> None:
        rng = self.rng
        for f in list(self.flights.values()):
            made = sum(s.produced for s in f.seqs)
            f.history.append(made)
            started = sum(1 for s in f.seqs if s.produced)
            if f.streamed and rng.random() < 0.7:
                lagged = f.history[max(0, len(f.history) - 1 - rng.randint(0, 8))]
                f.r.observe_output_tokens(lagged + started * rng.randint(0, PROGRESS_SLACK))
            if f.release_at is None and f.joins_at < self.step_no and all(s.done for s in f.seqs):
                f.release_at = self.step_no + rng.randint(0, 3)
            if f.release_at == self.step_no:
                f.r.observe_output_tokens(made)
                f.r.release()
                del self.flights[f.r]

    async def step(self, arrivals: bool = True) -> None:
        if arrivals and self.rng.random() < 0.6:
            self.arrive()
        await settle()
        self.board()
        self.run_engine()
        self.observe()
        await settle()
        self.step_no += 1
        self.peak_over_books = max(self.peak_over_books, self.rig.adm.committed - CAPACITY)


@pytest.mark.parametrize("seed", range(16))
async def test_time_aware_strict_keeps_the_engine_within_its_blocks_and_drains(seed: int) -> None:
    rig = Rig(kv_blocks=CAPACITY, block_size=BS, admission_policy="strict", prefix_sharing="on", time_aware="on",
              max_queue=16, queue_timeout=1e9)
    traffic = TimedTraffic(rig, random.Random(seed))
    for _ in range(STEPS):
        await traffic.step()
    while rig.adm.in_flight or rig.adm.queued:
        await traffic.step(arrivals=False)
    outcomes = await asyncio.gather(*(t for _, t in traffic.entered), return_exceptions=True)
    assert all(isinstance(o, (Reservation, errors.QueueFull)) for o in outcomes)
    rig.assert_drained()
    assert not traffic.engine.running and not traffic.engine.waiting
    assert traffic.peak_held > CAPACITY // 2  # the engine was kept busy
    assert traffic.peak_over_books > 0  # and the books went past the budget: time-aware admitted beyond strict
