"""One tenant's answers never shrink another tenant's bookings: whatever lengths the others send, in whatever order
and number, a tenant is booked at least at what its own history (or, with too little of it, the prior) gives,
for every quantile, every progress, and at every point of its projected survival."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.admission.curve import OFFSETS, request_curve
from gateway.admission.lengths import MIN_SAMPLES, OutputLengths, prior
from gateway.admission.projection import Outlook
from tests.unit.admission.booked import Booked

FAMILY, VICTIM = "m/chat", "victim"
MAX_TOKENS = 1024  # every sample and request in one bucket: the others' answers land where the victim's do

lengths = st.integers(min_value=1, max_value=MAX_TOKENS)
# The others: one or several tenants, any lengths (one-token answers, max_tokens ones, anything between).
others = st.lists(st.tuples(st.sampled_from(["hostile", "other"]), lengths), max_size=300)
# The victim's own answers, fewer or more than it needs to be booked from them.
own = st.lists(lengths, max_size=3 * MIN_SAMPLES)
queries = st.tuples(
    st.integers(min_value=0, max_value=MAX_TOKENS - 1),  # generated per sequence
    st.floats(min_value=0.05, max_value=0.99),  # the booking quantile
)
CHECKS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def learned(victims: list[int], others_: list[tuple[str, int]], seed: int) -> OutputLengths:
    """The victim's answers in their order, the others' interleaved among them as ``seed`` places them."""
    seen = OutputLengths()
    pending = list(victims)
    for k, (tenant, tokens) in enumerate(others_):
        if pending and (seed >> (k % 31)) & 1:
            seen.add(FAMILY, VICTIM, MAX_TOKENS, pending.pop(0))
        seen.add(FAMILY, tenant, MAX_TOKENS, tokens)
    for tokens in pending:
        seen.add(FAMILY, VICTIM, MAX_TOKENS, tokens)
    return seen


def alone(victims: list[int]) -> OutputLengths:
    return learned(victims, [], 0)


@CHECKS
@given(own, others, st.integers(min_value=0), st.lists(queries, min_size=1, max_size=8))
def test_no_answers_of_other_tenants_lower_a_tenants_expected_output(
    victims: list[int], others_: list[tuple[str, int]], seed: int, asked: list[tuple[int, float]]
) -> None:
    mixed, baseline = learned(victims, others_, seed), alone(victims)
    for generated, q in asked:
        floor = baseline.expected(FAMILY, VICTIM, MAX_TOKENS, generated, q)
        assert mixed.expected(FAMILY, VICTIM, MAX_TOKENS, generated, q) >= floor
        if len(victims) < MIN_SAMPLES and generated < prior(MAX_TOKENS):
            assert floor == prior(MAX_TOKENS)  # too few of its own: the prior, which no one else lowers


@CHECKS
@given(own, others, st.integers(min_value=0), st.integers(min_value=0, max_value=MAX_TOKENS - 1))
def test_no_answers_of_other_tenants_lower_a_tenants_chance_of_running_on(
    victims: list[int], others_: list[tuple[str, int]], seed: int, generated: int
) -> None:
    mixed, baseline = learned(victims, others_, seed), alone(victims)
    theirs = mixed.survival(FAMILY, VICTIM, MAX_TOKENS, generated, OFFSETS)
    mine = baseline.survival(FAMILY, VICTIM, MAX_TOKENS, generated, OFFSETS)
    assert all(a >= b for a, b in zip(theirs, mine, strict=True)), (theirs, mine)


@CHECKS
@given(own, others, st.integers(min_value=0), st.integers(min_value=0, max_value=MAX_TOKENS - 1),
       st.integers(min_value=0, max_value=MAX_TOKENS), st.floats(min_value=0.05, max_value=0.99))
def test_the_projected_blocks_of_a_tenants_request_are_never_lowered_by_others(
    victims: list[int], others_: list[tuple[str, int]], seed: int, generated: int, at_least: int, q: float
) -> None:
    """What admission books: the request's projected blocks at every offset (its mean; a request that surely runs
    ``at_least`` tokens holds its blocks until then, whatever anyone's lengths)."""
    r = Booked(prompt_tokens=500, max_tokens=MAX_TOKENS, generated=generated, min_output=at_least,
               tenant=VICTIM, family=FAMILY)
    mixed = request_curve(r, 16, Outlook(q, learned(victims, others_, seed)))
    baseline = request_curve(r, 16, Outlook(q, alone(victims)))
    assert all(a >= b for a, b in zip(mixed.mean, baseline.mean, strict=True))
    sure = request_curve(r, 16, Outlook(q, OutputLengths()))
    for s, mean, floor in zip(OFFSETS, mixed.mean, sure.mean, strict=True):
        if generated + s < at_least:
            assert mean == floor  # held for sure until then, learned lengths or not


def test_forty_one_token_answers_of_one_tenant_leave_anothers_booking_where_it_was() -> None:
    """One tenant's 40 one-token answers used to book another tenant's next requests at one token each."""
    seen = OutputLengths()
    for _ in range(40):
        seen.add(FAMILY, "hostile", MAX_TOKENS, 1)
    assert seen.expected(FAMILY, VICTIM, MAX_TOKENS, 0, 0.7) == prior(MAX_TOKENS)
    assert seen.expected(FAMILY, "hostile", MAX_TOKENS, 0, 0.7) == 1  # its own answers are its own affair
