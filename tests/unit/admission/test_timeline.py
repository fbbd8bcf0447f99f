"""Time-aware booking: the end steps read from progress, the peak of the summed curve (against a step-by-step brute
force), the timeline kept up to date within a pass, and strict admitting on it."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from gateway.admission.ledger import blocks_for, own_blocks
from gateway.admission.prefix import BlockKey
from gateway.admission.timeline import FOREVER, PROGRESS_SLACK, TimeAware, end_step, own_at, peak, timeline
from tests.unit.admission.rig import BS, Rig, enter, release_all, settle


@dataclass
class Req:
    prompt_tokens: int
    max_tokens: int
    n: int = 1
    generated: int = 0
    keys: tuple[BlockKey, ...] = ()

    @property
    def own_blocks(self) -> int:
        return own_blocks(self.prompt_tokens, self.max_tokens, self.n, BS, len(self.keys))


def chain(family: str, count: int) -> tuple[BlockKey, ...]:
    """``count`` chained keys of one prefix family: two families share no key, one family's chains share a prefix."""
    return tuple(f"{family}{j}".encode() for j in range(count))


def seen(tokens_per_sequence: int, n: int = 1) -> int:
    """The ``generated`` events a request shows once each sequence surely made ``tokens_per_sequence`` tokens."""
    return n * (tokens_per_sequence + PROGRESS_SLACK)


@pytest.mark.parametrize(
    ("req", "end"),
    [
        (Req(8, 100), FOREVER),  # nothing seen: unknown
        (Req(8, 100, generated=PROGRESS_SLACK), FOREVER),  # a role chunk's worth of events proves nothing
        (Req(8, 100, generated=seen(1)), 99),
        (Req(8, 100, generated=seen(100)), 0),  # at its last token: may still hold blocks this step
        (Req(8, 100, n=2, generated=seen(40) + seen(100)), 60),  # the slowest choice made at least 40
        (Req(8, 100, n=2, generated=seen(100)), FOREVER),  # one choice may have made all of them
    ],
)
def test_a_request_ends_by_its_max_tokens_less_what_each_sequence_surely_made(req: Req, end: float) -> None:
    assert end_step(req) == end


def brute_peak(in_flight: list[Req], cand: Req) -> int:
    """The model's sum at every step, one step at a time."""
    ends = [end_step(r) for r in in_flight]
    horizon = int(max([e for e in ends if e != FOREVER], default=0)) + cand.max_tokens + 2
    best = 0
    for s in range(horizon):
        alive = [r for r, e in zip(in_flight, ends, strict=True) if e >= s]
        keys = {k for r in alive for k in r.keys}
        total = sum(r.own_blocks for r in alive)
        if s <= cand.max_tokens:
            keys.update(cand.keys)
            total += own_at(cand, s, BS)
        best = max(best, total + len(keys))
    return best


def random_req(rng: random.Random) -> Req:
    prompt = rng.randint(1, 90)
    family = rng.choice("abc")
    shared = (prompt - 1) // BS if family != "c" else 0
    max_tokens = rng.randint(1, 120)
    n = rng.choice([1, 1, 2])
    generated = rng.choice([0, rng.randint(0, n * (max_tokens + PROGRESS_SLACK))])
    return Req(prompt, max_tokens, n, generated, chain(family, shared))


@pytest.mark.parametrize("seed", range(40))
def test_the_peak_is_the_step_by_step_maximum_and_never_above_the_books(seed: int) -> None:
    rng = random.Random(seed)
    in_flight = [random_req(rng) for _ in range(rng.randint(0, 8))]
    cand = random_req(rng)
    tl = timeline(in_flight)
    got = peak(tl, cand, BS)
    assert got == brute_peak(in_flight, cand)
    committed = sum(r.own_blocks for r in in_flight) + len({k for r in in_flight for k in r.keys})
    assert tl.held_at(0) == committed
    need = cand.own_blocks + len(set(cand.keys) - {k for r in in_flight for k in r.keys})
    assert got <= committed + need  # time-aware strict admits whatever strict admits


@pytest.mark.parametrize("seed", range(20))
def test_a_request_admitted_in_the_pass_counts_as_if_the_timeline_were_built_with_it(seed: int) -> None:
    rng = random.Random(seed)
    in_flight = [random_req(rng) for _ in range(rng.randint(0, 8))]
    admitted = random_req(rng)
    admitted.generated = 0
    cand = random_req(rng)
    tl = timeline(in_flight)
    tl.add(admitted)
    rebuilt = timeline([*in_flight, admitted])
    assert (tl.ends, tl.held, tl.tail) == (rebuilt.ends, rebuilt.held, rebuilt.tail)
    assert peak(tl, cand, BS) == peak(rebuilt, cand, BS)


def test_a_candidate_grows_into_the_blocks_of_a_request_about_to_end() -> None:
    ending = Req(8, 88, generated=seen(83))  # 6 blocks at full size, ends by step 5
    cand = Req(8, 88)  # 1 block now, 6 at step 88
    tl = timeline([ending])
    assert (tl.ends, tl.held, tl.tail) == ([5], [6], 0)
    assert peak(tl, cand, BS) == max(6 + blocks_for(8 + 5, BS), 6)  # 7: where the books say 12


def test_a_shared_prefix_is_held_until_its_last_holder_ends() -> None:
    prefix = chain("p", 3)
    short = Req(60, 20, generated=seen(15), keys=prefix)  # ends by step 5
    long = Req(60, 200, generated=seen(100), keys=prefix)  # ends by step 100
    tl = timeline([short, long])
    own = own_blocks(60, 20, 1, BS, 3), own_blocks(60, 200, 1, BS, 3)
    assert (tl.ends, tl.held) == ([5, 100], [3 + own[0] + own[1], 3 + own[1]])
    assert tl.key_end == dict.fromkeys(prefix, 100)


async def test_strict_with_time_aware_admits_a_request_that_overlaps_an_end_and_shows_it() -> None:
    for mode, admitted_at_once in (("off", False), ("on", True)):
        rig = Rig(admission_policy="strict", time_aware=mode)  # 10 blocks
        first = await rig.req(6).__aenter__()
        first.observe_output_tokens(seen(83))  # 88 allowed: five tokens left
        second = rig.req(6)
        task = enter(second)
        await settle()
        assert second.admitted is admitted_at_once
        status = rig.adm.status()["time_aware"]
        if mode == "on":
            assert status == {"on": True, "tracked_in_flight": 1, "next_end_step": 5, "head_peak_blocks": None}
            assert rig.adm.committed == 12  # the books show both at full size
        else:
            assert status == {"on": False}
        await release_all(rig, [first, second], [task])


async def test_status_shows_the_peak_the_head_of_the_queue_would_bring() -> None:
    rig = Rig(admission_policy="strict", time_aware="on")
    first = await rig.req(6).__aenter__()
    first.observe_output_tokens(seen(20))  # ends by step 68: the second would hold 5 blocks by then
    second = rig.req(6)
    task = enter(second)
    await settle()
    assert not second.admitted
    assert rig.adm.status()["time_aware"]["head_peak_blocks"] == 6 + blocks_for(8 + 68, BS) == 11
    await release_all(rig, [first, second], [task])


def test_off_never_admits_past_the_books() -> None:
    assert not TimeAware(False).fits(Req(8, 8), [], BS, 100)
