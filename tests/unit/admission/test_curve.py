"""The default policy's projection: the usage the requests in flight are expected to hold over the tokens to come."""

from __future__ import annotations

import random

import pytest

from gateway.admission.curve import OFFSETS, request_curve, usage_curve
from gateway.admission.lengths import OutputLengths
from gateway.admission.projection import Outlook
from tests.unit.admission.booked import EIGHT, SPREAD, Booked, stopped_at

REST = len(OFFSETS)


def padded(*values: float) -> list[float]:
    """``values`` at the first offsets, the last one for the rest."""
    return [*values, *[values[-1]] * (REST - len(values))]


# A request of a 152-token prompt allowed 168 tokens, in blocks of 16: 10 blocks with no output, 11 at 16 tokens,
# 12 at 32, 14 at 64, 18 at 128, 20 at its max_tokens.
@pytest.mark.parametrize(
    ("booked", "outlook", "mean"),
    [
        # The worst case: it runs to max_tokens and holds its blocks.
        (Booked(), Outlook(1.0, EIGHT), padded(10, 11, 12, 14, 18, 20)),
        (Booked(), Outlook(0.7, None), padded(10, 11, 12, 14, 18, 20)),
        # Every answer stopped at 8: it may cross into its 11th block before it ends, then holds nothing.
        (Booked(), Outlook(0.7, EIGHT), padded(10, 11, 0)),
        # Nothing learned yet: taken to end at a quarter of max_tokens, 42 tokens.
        (Booked(), Outlook(0.7, OutputLengths()), padded(10, 11, 12, 14, 0)),
        # Past 8 tokens, half of the longer answers end at 40 and half run to 100.
        (Booked(generated=8), Outlook(0.5, SPREAD), padded(10, 11, 12, 0.5 * 14, 0.5 * 18, 0)),
        # Past every length seen: taken to end at twice what it generated, 16.
        (Booked(generated=8), Outlook(0.7, EIGHT), padded(10, 11, 0)),
    ],
)
def test_a_request_is_expected_to_grow_until_it_is_likely_to_have_ended(
    booked: Booked, outlook: Outlook, mean: list[float]
) -> None:
    curve = request_curve(booked, 16, outlook)
    assert curve.mean == pytest.approx(mean)
    assert curve.full == 20


def test_the_spread_of_a_request_is_that_of_running_or_not() -> None:
    curve = request_curve(Booked(generated=8), 16, Outlook(0.5, SPREAD))
    assert curve.var == pytest.approx(padded(0, 0, 0, 0.25 * 14 * 14, 0.25 * 18 * 18, 0))


def test_requests_that_end_at_different_times_are_not_all_counted_at_their_largest() -> None:
    # One is likely to end at 40 tokens, the other runs on to 100: the second grows as the first ends.
    running = [Booked(generated=8, credited=8), Booked(generated=40, credited=40)]
    curve = usage_curve(22, running, 16, Outlook(0.5, SPREAD))
    assert curve.level == pytest.approx(padded(22, 24, 26, 22 - 3 + 4, 22 - 1 - 12, 0))
    # At the median each would be booked at its expected end (12 and 16 blocks): 28 in all.
    assert curve.peak() == pytest.approx(26)


def test_the_booking_quantile_keeps_room_for_the_spread_and_never_past_the_worst_case() -> None:
    running = [Booked(generated=8, credited=8) for _ in range(4)]
    peaks = [usage_curve(40, running, 16, Outlook(q, SPREAD)).peak() for q in (0.5, 0.7, 0.9, 0.999, 1.0)]
    assert peaks == sorted(peaks)
    assert peaks[0] == pytest.approx(48) and peaks[-1] == 40 + 4 * (20 - 10)
    assert peaks[-2] <= peaks[-1]


def test_the_projection_keeps_the_smaller_of_its_two_bounds() -> None:
    outlook = Outlook(0.7, EIGHT)
    progressing = [Booked(generated=8, credited=8) for _ in range(5)]
    unknown = [Booked(generated=8) for _ in range(5)]
    # Seen progressing: live usage plus a block each before they end.
    assert usage_curve(50, progressing, 16, outlook).peak() == 55
    # Progress unknown: on top of live usage they would count twice (50 + 55); their sizes together bound it.
    assert usage_curve(50, unknown, 16, outlook).peak() == 55
    assert usage_curve(70, unknown, 16, outlook).peak() == 70  # never below what the engine holds now
    assert usage_curve(0, [], 16, outlook).peak() == 0


def sharer(prefix: str, shared: int, *, added: bool = False, credited: int | None = None) -> Booked:
    """The 20-block request above whose first ``shared`` prompt blocks are shared (``added``: it booked them)."""
    keys = tuple(f"{prefix}{i}" for i in range(shared))
    own = 20 - shared
    return Booked(
        blocks=own + (shared if added else 0), prefix_blocks=shared if added else 0, shared_blocks=shared, keys=keys,
        credited=credited,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("in_flight", "live", "shared_held", "projected"),
    [
        # The request that added the 9 shared blocks has ended; its two sharers were not seen running, and the
        # usage (from before they were scheduled) holds none of it: the shared blocks come on top (11 own each).
        ([sharer("a", 9), sharer("a", 9)], 0, 9, 0 + 11 + 11 + 9),
        # One sharer seen running (its prompt's tail block in use): the usage holds the shared blocks.
        ([sharer("a", 9, credited=0), sharer("a", 9)], 10, 9, 10 + 10 + 11),
        # The one that added them is in flight, not seen running: its own curve counts them.
        ([sharer("a", 9, added=True), sharer("a", 9)], 0, 9, 20 + 11),
        # Two prefixes, only the first held by a request seen running: the second's 5 blocks come on top.
        ([sharer("a", 9, credited=0), sharer("b", 5)], 10, 14, 10 + 10 + 15 + 5),
    ],
)
def test_shared_blocks_not_surely_in_the_live_usage_are_projected_on_top_of_it(
    in_flight: list[Booked], live: int, shared_held: int, projected: int
) -> None:
    assert usage_curve(live, in_flight, 16, Outlook(1.0, None), shared_held).peak() == projected


def test_a_request_admitted_in_a_pass_is_counted_as_if_it_had_been_in_flight() -> None:
    running = [Booked(generated=8, credited=8), Booked(generated=40, credited=40)]
    newcomer = Booked()
    outlook = Outlook(0.7, SPREAD)
    curve = usage_curve(22, running, 16, outlook)
    with_it = curve.peak(request_curve(newcomer, 16, outlook))
    curve.add(request_curve(newcomer, 16, outlook))
    assert curve.peak() == pytest.approx(with_it)
    assert with_it == pytest.approx(usage_curve(22, [*running, newcomer], 16, outlook).peak())


# -- properties: seeded random populations ------------------------------------------------------------------
def random_request(rng: random.Random) -> Booked:
    prompt, max_tokens, n = rng.randint(1, 400), rng.randint(1, 600), rng.randint(1, 3)
    generated = rng.randint(0, n * max_tokens)
    credited = None if rng.random() < 0.3 else rng.randint(0, generated)
    return Booked(prompt_tokens=prompt, max_tokens=max_tokens, n=n, blocks=n * -(-(prompt + max_tokens) // 16),
                  generated=generated, credited=credited)


@pytest.mark.parametrize("seed", range(300))
def test_the_projection_is_monotone_in_the_quantile_bounded_by_the_worst_case_and_grows_with_each_admission(
    seed: int,
) -> None:
    rng = random.Random(seed)
    seen = OutputLengths()
    for _ in range(rng.randint(0, 40)):
        seen.add("m/chat", "default", rng.choice((300, 600)), rng.randint(1, 600))
    in_flight = [random_request(rng) for _ in range(rng.randint(0, 12))]
    live = rng.randint(0, 400)
    low, high = sorted(rng.uniform(0.5, 0.999) for _ in range(2))
    worst = usage_curve(live, in_flight, 16, Outlook(1.0, seen)).peak()
    at_low = usage_curve(live, in_flight, 16, Outlook(low, seen))
    assert at_low.peak() <= usage_curve(live, in_flight, 16, Outlook(high, seen)).peak() + 1e-9
    assert at_low.peak() <= worst + 1e-9
    before = at_low.peak()
    at_low.add(request_curve(random_request(rng), 16, Outlook(low, seen)))
    assert at_low.peak() >= before - 1e-9


def test_lengths_learned_for_another_max_tokens_do_not_count() -> None:
    seen = stopped_at(8, 8, 8, 8, 8, 8, 8, 8)
    other = Booked(max_tokens=2000)
    assert request_curve(other, 16, Outlook(0.7, seen)).mean[:3] == request_curve(
        other, 16, Outlook(0.7, OutputLengths())
    ).mean[:3]


# -- requests the engine has ended while the gateway still relays them --------------------------------------
@pytest.mark.parametrize(
    ("engine", "peak"),
    [
        (None, 5 * 20),  # no count from the engine: every request not seen running is counted whole
        ((5, 10.0), 5 * 20),  # the engine holds all five (queued, not yet running)
        ((2, 10.0), 2 * 20),  # it holds two: the other three ended there, whatever the gateway still relays
        ((0, 10.0), 0),
        ((0, 2.0), 5 * 20),  # counted before they were admitted: they may still be on their way
    ],
)
def test_requests_the_engine_no_longer_holds_add_nothing_to_its_usage(
    engine: tuple[int, float] | None, peak: int
) -> None:
    # Five requests admitted at 5 s, never seen running; the engine's count was read at ``engine[1]``.
    unseen = [Booked(admitted_at=5.0) for _ in range(5)]
    assert usage_curve(0, unseen, 16, Outlook(1.0, None), engine=engine, transit=1.0).peak() == peak


def test_the_largest_requests_are_the_ones_kept_in_the_engine() -> None:
    small, large = Booked(admitted_at=5.0, max_tokens=8, blocks=10), Booked(admitted_at=5.0)
    assert usage_curve(0, [small, large], 16, Outlook(1.0, None), engine=(1, 10.0)).peak() == 20
    # Seen running or not: the stream lags the engine (vLLM's API server writes behind its engine).
    running = Booked(admitted_at=5.0, generated=8, credited=8)
    # One of the two is still in the engine: at most the 10 blocks it holds plus 10 to grow.
    assert usage_curve(10, [running, large], 16, Outlook(1.0, None), engine=(1, 10.0)).peak() == 10 + 10
    assert usage_curve(0, [running, large], 16, Outlook(1.0, None), engine=(0, 10.0)).peak() == 0
