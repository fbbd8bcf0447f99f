from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from gateway.admission.ledger import (
    Capacity,
    Ledger,
    blocks_for,
    blocks_in_use_at_least,
    capacity_from,
    request_need,
)
from gateway.config import Settings
from gateway.engine.live import never_scraped

ENGINE = replace(never_scraped(0.0), ok=True, has_metrics=True, num_gpu_blocks=32, block_size=128)
NO_INFO = replace(never_scraped(0.0), ok=True, has_metrics=False)
ONLY_BLOCK_SIZE = replace(NO_INFO, block_size=128)


@pytest.mark.parametrize(
    ("tokens", "block_size", "blocks"),
    [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (4096, 128, 32), (4097, 128, 33), (-5, 16, 0)],
)
def test_blocks_for_rounds_up(tokens: int, block_size: int, blocks: int) -> None:
    assert blocks_for(tokens, block_size) == blocks


def test_blocks_for_refuses_a_zero_block_size() -> None:
    with pytest.raises(ValueError, match="block_size must be positive"):
        blocks_for(10, 0)


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "n", "block_size", "need"),
    [
        (10, 6, 1, 16, 1),  # prompt and output share the last block
        (10, 7, 1, 16, 2),
        (1000, 900, 1, 128, 15),  # the preemption scenario of the CPU notes: 1,900 tokens
        (100, 28, 2, 128, 2),  # each of the n sequences holds its own copy of the prompt
        (100, 29, 3, 128, 6),
        (0, 16, 1, 16, 1),
        (16, 0, 1, 16, 1),
    ],
)
def test_request_need_counts_each_sequence_with_its_prompt(
    prompt: int, max_tokens: int, n: int, block_size: int, need: int
) -> None:
    assert request_need(prompt, max_tokens, n, block_size) == need


def test_request_need_refuses_n_below_one() -> None:
    with pytest.raises(ValueError, match="n must be at least 1, got 0"):
        request_need(10, 10, 0, 16)


@pytest.mark.parametrize(
    ("prompt", "generated", "n", "block_size", "at_least"),
    [
        (100, 0, 1, 16, 7),
        (100, 30, 1, 16, 9),
        (100, 0, 3, 16, 21),  # every sequence holds its prompt blocks
        (10, 100, 2, 16, 8),  # all tokens together: 2 x 10 + 100 = 120 -> 8 blocks
    ],
)
def test_blocks_in_use_is_a_lower_bound(prompt: int, generated: int, n: int, block_size: int, at_least: int) -> None:
    assert blocks_in_use_at_least(prompt, generated, n, block_size) == at_least


@pytest.mark.parametrize(
    ("snapshot", "flags", "expected"),
    [
        (ENGINE, {}, Capacity(31, 128, "engine")),  # 32 reported, one of them vLLM's null block
        (ENGINE, {"kv_blocks": 10, "block_size": 16}, Capacity(31, 128, "engine")),  # the engine wins
        (None, {}, None),
        (NO_INFO, {}, None),
        (None, {"kv_blocks": 500}, Capacity(500, 16, "flags")),  # vLLM's GPU default block size
        (None, {"kv_blocks": 500, "block_size": 32}, Capacity(500, 32, "flags")),
        (None, {"kv_tokens": 4096, "block_size": 128}, Capacity(32, 128, "flags")),
        (None, {"kv_tokens": 4100}, Capacity(256, 16, "flags")),  # a partial block is no block
        (None, {"kv_tokens": 10}, None),
        (ONLY_BLOCK_SIZE, {"kv_tokens": 4096, "block_size": 16}, Capacity(32, 128, "flags")),
        (None, {"kv_blocks": 7, "kv_tokens": 4096}, Capacity(7, 16, "flags")),
    ],
)
def test_capacity_comes_from_the_engine_first_then_flags(
    snapshot: Any, flags: dict[str, Any], expected: Capacity | None
) -> None:
    assert capacity_from(snapshot, Settings(**flags)) == expected


def test_capacity_counts_tokens() -> None:
    assert Capacity(32, 128, "engine").tokens == 4096


def test_ledger_returns_to_zero_after_commits_and_releases() -> None:
    ledger = Ledger()
    for blocks in (3, 5, 0):
        ledger.commit(blocks)
    assert (ledger.committed, ledger.in_flight) == (8, 3)
    for blocks in (5, 0, 3):
        ledger.release(blocks)
    assert (ledger.committed, ledger.in_flight) == (0, 0)


@pytest.mark.parametrize("blocks", [4, -1])
def test_ledger_refuses_a_release_it_did_not_commit(blocks: int) -> None:
    ledger = Ledger()
    ledger.commit(3)
    with pytest.raises(ValueError, match="does not match the ledger"):
        ledger.release(blocks)
    assert ledger.committed == 3


def test_ledger_refuses_negative_commits() -> None:
    with pytest.raises(ValueError, match="negative"):
        Ledger().commit(-1)


def test_ledger_resizes_an_entry() -> None:
    ledger = Ledger()
    ledger.commit(8)
    ledger.resize(8, 2)
    assert (ledger.committed, ledger.in_flight) == (2, 1)
    with pytest.raises(ValueError, match="cannot resize"):
        ledger.resize(5, 1)
