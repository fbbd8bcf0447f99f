"""The ordered floats hold and answer what one sorted list would, under any sequence of additions and removals:
equal values, values past every chunk, chunks split and emptied; a value not held is refused by name."""

from __future__ import annotations

import bisect

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission.ordered import OrderedFloats

# An operation: add a value (a few distinct ones, so that equal values are common), or remove the one at a place.
OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, 7.25, 1e9, float("inf")])),
        st.tuples(st.just("add"), st.floats(min_value=0.0, max_value=100.0)),
        st.tuples(st.just("remove"), st.integers(min_value=0, max_value=10_000)),
    ),
    max_size=400,
)


@settings(max_examples=200, deadline=None)
@given(operations=OPERATIONS, chunk=st.sampled_from([1, 2, 3, 8]))
def test_it_holds_and_answers_as_one_sorted_list(operations: list[tuple[str, float]], chunk: int) -> None:
    ordered, reference = OrderedFloats(chunk), []
    for op, arg in operations:
        if op == "add":
            ordered.add(arg)
            bisect.insort(reference, arg)
        elif reference:
            value = reference.pop(int(arg) % len(reference))
            ordered.remove(value)
        assert len(ordered) == len(reference)
    assert ordered.values() == reference
    assert [ordered.at(i) for i in range(len(reference))] == reference


@pytest.mark.parametrize(
    ("held", "missing"),
    [([], 1.0), ([1.0, 2.0], 1.5), ([1.0, 2.0], 3.0), ([1.0, 2.0], 0.5)],
)
def test_removing_a_value_not_held_is_refused_by_name(held: list[float], missing: float) -> None:
    ordered = OrderedFloats(1)
    for value in held:
        ordered.add(value)

    with pytest.raises(ValueError, match=f"{missing!r} is not held"):
        ordered.remove(missing)
    assert ordered.values() == held


@pytest.mark.parametrize("index", [-1, 3])
def test_a_place_outside_the_values_is_refused(index: int) -> None:
    ordered = OrderedFloats()
    for value in (3.0, 1.0, 2.0):
        ordered.add(value)

    with pytest.raises(IndexError, match=f"index {index} of 3 values"):
        ordered.at(index)
