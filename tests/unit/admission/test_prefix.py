"""A prompt's shareable blocks and their keys follow vLLM's prefix cache: full blocks before the last prompt token,
each key chained to the one before it and salted with what changes vLLM's keys."""

from __future__ import annotations

import pytest

from gateway.admission.prefix import PromptPrefix, block_keys, shareable_blocks
from gateway.admission.sharing import SharedBlocks

BS = 16


@pytest.mark.parametrize(
    ("prompt_tokens", "expected"),
    [(0, 0), (1, 0), (16, 0), (17, 1), (32, 1), (33, 2), (160, 9), (161, 10)],
)
def test_only_full_blocks_before_the_last_prompt_token_are_shareable(prompt_tokens: int, expected: int) -> None:
    assert shareable_blocks(prompt_tokens, BS) == expected


def ids(n: int, start: int = 0) -> list[int]:
    return [(start + i) % 500 for i in range(n)]


def test_a_prompt_has_one_key_per_shareable_block_and_equal_prefixes_have_equal_keys() -> None:
    a = block_keys(PromptPrefix(ids(100)), BS)
    b = block_keys(PromptPrefix(ids(64) + [7] * 36), BS)
    assert len(a) == shareable_blocks(100, BS) == 6
    assert a[:4] == b[:4] and a[4] != b[4]  # the first 64 tokens agree, the fifth block differs
    assert len(set(a)) == len(a)


def test_a_difference_in_one_block_changes_that_key_and_every_key_after_it() -> None:
    base = ids(97)
    changed = list(base)
    changed[40] += 1  # inside the third block
    a, b = block_keys(PromptPrefix(base), BS), block_keys(PromptPrefix(changed), BS)
    assert a[:2] == b[:2]
    assert all(x != y for x, y in zip(a[2:], b[2:], strict=True))


@pytest.mark.parametrize(
    ("salt_a", "salt_b"),
    [("base-model\0", "lora-adapter\0"), ("m\0", "m\0tenant-salt"), ("m\0a", "m\0b")],
)
def test_a_different_model_or_cache_salt_shares_nothing(salt_a: str, salt_b: str) -> None:
    a = block_keys(PromptPrefix(ids(80), salt_a), BS)
    b = block_keys(PromptPrefix(ids(80), salt_b), BS)
    assert not set(a) & set(b)


def test_ids_no_engine_would_accept_share_nothing() -> None:
    assert block_keys(PromptPrefix([2**70] * 40), BS) == ()


def test_a_prompt_of_one_block_or_less_has_no_keys() -> None:
    assert block_keys(PromptPrefix(ids(16)), BS) == ()


# -- shared blocks ---------------------------------------------------------------------------------
def test_shared_blocks_are_held_once_and_freed_with_their_last_holder() -> None:
    shared = SharedBlocks()
    long, short = block_keys(PromptPrefix(ids(161)), BS), block_keys(PromptPrefix(ids(81)), BS)
    assert shared.missing(long) == 10
    assert shared.hold(long) == 10
    assert shared.missing(short) == 0 and shared.held_prefix(short) == 5
    assert shared.hold(short) == 0
    assert (shared.held, shared.references) == (10, 15)
    assert shared.release(long) == 5  # the last five were held by the long prompt alone
    assert shared.missing(long) == 5 and shared.held_prefix(long) == 5
    assert shared.release(short) == 5
    assert (shared.held, shared.references) == (0, 0)


def test_releasing_a_block_nobody_holds_is_a_ledger_error() -> None:
    with pytest.raises(ValueError, match="not held"):
        SharedBlocks().release(block_keys(PromptPrefix(ids(40)), BS))
