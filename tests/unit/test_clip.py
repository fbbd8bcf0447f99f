"""A value a client controls is shown whole up to its bound, else cut in one documented form: its start, then
its length and a hash of it that tells cut values apart, never longer than the bound, at a cost that does not
grow with the value."""

from __future__ import annotations

import re
import time

import pytest

from gateway.clip import FIELD_CHARS, SAMPLE, clip, digest

CUT = re.compile(r"^(.*)\.\.\.\[cut: (\d+) chars, ([0-9a-f]{12})\]$", re.DOTALL)


@pytest.mark.parametrize("value", ["", "tiny", "x" * FIELD_CHARS], ids=["empty", "short", "at the bound"])
def test_a_value_within_the_bound_is_shown_whole(value: str) -> None:
    assert clip(value) == value


@pytest.mark.parametrize("length", [FIELD_CHARS + 1, 10_000, 8 * 1024 * 1024])
@pytest.mark.parametrize("limit", [64, FIELD_CHARS, 16 * 1024])
def test_a_longer_value_is_its_start_then_its_length_and_hash_within_the_bound(length: int, limit: int) -> None:
    value = ("ab\u00e9\U0001f600" * length)[:length]
    cut = clip(value, limit)
    if length <= limit:
        assert cut == value
        return
    match = CUT.match(cut)
    assert match is not None, cut[-80:]
    head, told, hashed = match.groups()
    assert len(cut) <= limit and value.startswith(head) and head
    assert (int(told), hashed) == (length, digest(value))


@pytest.mark.parametrize(("a", "b"), [
    ("a" * 10_000, "b" + "a" * 9_999),  # differ in the first character
    ("a" * 10_000, "a" * 9_999 + "b"),  # in the last
    ("a" * 10_000, "a" * 10_001),  # in length only
], ids=["start", "end", "length"])
def test_values_that_differ_at_their_ends_or_in_length_hash_apart(a: str, b: str) -> None:
    assert digest(a) != digest(b) and digest(a) == digest(str(a))


def test_a_value_with_lone_surrogates_is_hashed_too() -> None:
    assert CUT.match(clip("\ud800" * 1000)) is not None


def test_the_cost_does_not_grow_with_the_value() -> None:
    """The hash reads the first and last SAMPLE characters: an 8 MiB value costs what a 16 KiB one does (a hash
    of all of it took 20-60 ms on the 2-core test machine); 20 ms allows a busy host."""
    value = "\u00e9" * (8 * 1024 * 1024)
    assert len(value) > 4 * SAMPLE
    started = time.perf_counter()
    for _ in range(10):
        clip(value)
    assert (time.perf_counter() - started) / 10 < 0.02
