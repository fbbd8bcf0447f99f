"""The answers' lengths the default policy books from: quantiles of what really ran, grown past what a request
has generated, per family, tenant and max_tokens bucket; never max_tokens below quantile 1."""

from __future__ import annotations

import math
import random

import pytest

from gateway.admission.lengths import MIN_SAMPLES, WINDOW, OutputLengths, bucket, prior


@pytest.mark.parametrize(("max_tokens", "b"), [(1, 0), (2, 1), (16, 4), (17, 5), (513, 10), (1024, 10), (1025, 11)])
def test_buckets_are_powers_of_two(max_tokens: int, b: int) -> None:
    assert bucket(max_tokens) == b


def test_with_too_few_samples_a_request_is_booked_at_a_quarter_of_max_tokens() -> None:
    seen = OutputLengths()
    for _ in range(MIN_SAMPLES - 1):
        seen.add("m/chat", "t", 1024, 900)
    assert seen.expected("m/chat", "t", 1024, 0, 0.7) == prior(1024) == 256
    assert seen.expected("m/chat", "t", 1024, 300, 0.7) == 600  # past its prior: twice what it generated
    assert seen.expected("m/chat", "t", 8, 0, 0.7) == 8  # never past max_tokens
    seen.add("m/chat", "t", 1024, 900)
    assert seen.expected("m/chat", "t", 1024, 0, 0.7) == 900


def test_quantile_one_is_the_worst_case() -> None:
    seen = OutputLengths()
    for _ in range(MIN_SAMPLES):
        seen.add("m/chat", "t", 1024, 10)
    assert seen.expected("m/chat", "t", 1024, 0, 1.0) == 1024


def test_families_and_buckets_are_learned_apart() -> None:
    seen = OutputLengths()
    for _ in range(MIN_SAMPLES):
        seen.add("m/chat", "t", 1024, 50)
        seen.add("m/completions", "t", 1024, 500)
        seen.add("m/chat", "t", 64, 64)
    assert seen.expected("m/chat", "t", 1000, 0, 0.5) == 50
    assert seen.expected("m/completions", "t", 1000, 0, 0.5) == 500
    assert seen.expected("m/chat", "t", 64, 0, 0.5) == 64
    assert seen.expected("m/chat", "t", 4096, 0, 0.5) == prior(4096)  # no samples in that bucket


def test_a_tenant_is_booked_from_its_own_lengths_once_it_has_enough_and_from_the_prior_before() -> None:
    seen = OutputLengths()
    for _ in range(64):
        seen.add("m/chat", "others", 1024, 100)
    for i in range(MIN_SAMPLES):
        # The others' short answers do not lower a new tenant's booking below the prior.
        assert seen.expected("m/chat", "long", 1024, 0, 0.5) == prior(1024), i
        seen.add("m/chat", "long", 1024, 800)
    assert seen.expected("m/chat", "long", 1024, 0, 0.5) == 800
    assert seen.expected("m/chat", "others", 1024, 0, 0.5) == 100


def test_the_familys_longer_answers_raise_a_new_tenants_prior() -> None:
    seen = OutputLengths()
    for _ in range(MIN_SAMPLES):
        seen.add("m/chat", "others", 1024, 900)
    assert seen.expected("m/chat", "new", 1024, 0, 0.5) == 900
    assert seen.survival("m/chat", "new", 1024, 0, [0, 256, 899, 900]) == [1.0, 1.0, 1.0, 0.0]


@pytest.mark.parametrize(("at_least", "generated", "booked"), [
    (0, 0, 8), (100, 0, 100), (100, 99, 100), (100, 100, 200), (1024, 0, 1024), (2000, 0, 1024),
], ids=["nothing known", "min_tokens 100", "one token short of it", "past it: grows as before",
        "ignore_eos: max_tokens", "never past max_tokens"])
def test_what_a_request_surely_generates_is_booked_whatever_was_learned(
    at_least: int, generated: int, booked: int
) -> None:
    seen = OutputLengths()
    for _ in range(MIN_SAMPLES):
        seen.add("m/chat", "t", 1024, 8)
    assert seen.expected("m/chat", "t", 1024, generated, 0.7, at_least) == booked
    alive = seen.survival("m/chat", "t", 1024, generated, [0, 16, 64, 512], at_least)
    assert alive == [1.0 if generated + s < max(at_least, booked) else 0.0 for s in (0, 16, 64, 512)]


def test_the_window_forgets_the_oldest_lengths() -> None:
    seen = OutputLengths()
    for _ in range(WINDOW):
        seen.add("f", "t", 1024, 900)
    for _ in range(WINDOW):
        seen.add("f", "t", 1024, 30)
    assert seen.expected("f", "t", 1024, 0, 0.99) == 30


@pytest.mark.parametrize("seed", range(20))
def test_bookings_are_bounded_monotone_and_cover_their_quantile(seed: int) -> None:
    """Lognormal lengths (the benchmark's shape): whatever was generated and whatever the quantile, the booking is
    above what was generated, within max_tokens, grows with both, and at least a share q of the lengths
    longer than what was generated end within it."""
    rng = random.Random(seed)
    max_tokens = rng.choice([256, 1024, 4096])
    lengths = [min(max_tokens, max(1, round(rng.lognormvariate(math.log(200), 0.8)))) for _ in range(WINDOW)]
    seen = OutputLengths()
    for tokens in lengths:
        seen.add("f", "t", max_tokens, tokens)
    for _ in range(50):
        generated = rng.randint(0, max_tokens - 1)
        q = rng.uniform(0.05, 0.99)
        booked = seen.expected("f", "t", max_tokens, generated, q)
        assert generated < booked <= max_tokens
        assert seen.expected("f", "t", max_tokens, generated + rng.randint(1, 50), q) >= booked
        assert seen.expected("f", "t", max_tokens, generated, min(0.99, q + 0.1)) >= booked
        longer = [t for t in lengths if t > generated]
        if longer:
            assert sum(t <= booked for t in longer) >= q * len(longer)
