"""The text counter's memory: its piece cache bounded in bytes, nothing kept of a prompt longer than the context,
and memory freed after a huge encoding given back to the system."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from gateway.guard.counting import TextCounter
from gateway.guard.counting import text as text_module

EMOJI = "\U0001f600"


def test_the_cache_never_holds_more_bytes_than_its_bound(tokenizer: Any) -> None:
    counter = TextCounter(tokenizer, cache_bytes=64 * 1024)
    for i in range(400):
        counter.count(f"turn {i}: " + "some prose to remember " * 8)
        assert counter.cached_bytes <= 64 * 1024
    assert counter.cached_bytes > 32 * 1024, "the cache should be in use, near its bound"


def test_a_piece_is_charged_for_its_bytes_not_its_characters(tokenizer: Any) -> None:
    # 2,000 emoji: 2,000 characters, but 4 bytes each in memory plus ~4 ids each at 8 bytes.
    piece = EMOJI * 2000
    cost = sys.getsizeof(piece) + 8 * len(tokenizer(piece, add_special_tokens=False)["input_ids"])
    roomy = TextCounter(tokenizer, cache_bytes=cost * 8 * 2)
    tight = TextCounter(tokenizer, cache_bytes=cost * 8 // 2)  # its largest piece: half of this one's cost
    for counter in (roomy, tight):
        counter.count(piece)
    assert roomy.cached_bytes >= cost
    assert tight.cached_bytes == 0


@pytest.mark.parametrize(("longest", "kept"), [(None, True), (10_000, True), (50, False)])
def test_a_piece_longer_than_the_context_is_counted_but_not_kept(
    tokenizer: Any, longest: int | None, kept: bool
) -> None:
    counter = TextCounter(tokenizer, longest=lambda: longest)
    text = "a prompt that is refused or cut as too long " * 20
    assert counter.count(text) == len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert (counter.cached_bytes > 0) is kept


def test_memory_is_given_back_after_a_huge_encoding_only(tokenizer: Any, monkeypatch: Any) -> None:
    calls: list[int] = []
    monkeypatch.setattr(text_module, "release_freed_memory", lambda: calls.append(1))
    counter = TextCounter(tokenizer)
    counter.count("short " * 100)
    assert calls == []
    counter.count("x " * (text_module.RELEASE_AFTER_CHARS // 2 + 1))
    assert calls == [1]


def test_giving_memory_back_is_safe_to_call() -> None:
    text_module.release_freed_memory()
