"""One engine as admission books it: a data-parallel rank reads only its own figures, a site remembers the prompts it
finished lately (least recent forgotten first), and the tenants' headroom is split among the sites by budget."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from gateway.admission.prefix import BlockKey
from gateway.admission.site import RecentPrefixes, SiteHeadroom, rank_snapshot
from gateway.engine.live import EngineSnapshot
from gateway.engine.vllm_api.metrics import RankMetrics

RANK_1 = RankMetrics(
    kv_usage=0.25, running=3, waiting=1, preemptions_total=2.0, generation_tokens_total=500.0, num_gpu_blocks=65
)
ENGINE = EngineSnapshot(
    taken_at=5.0, ok=True, has_metrics=True, kv_usage=0.5, running=7, waiting=2, preemptions_total=4.0,
    generation_tokens_total=900.0, num_gpu_blocks=129, block_size=16, prefix_caching=True,
    ranks={"0": RankMetrics(kv_usage=0.75, running=4, waiting=1, num_gpu_blocks=129), "1": RANK_1},
)


# -- rank_snapshot --------------------------------------------------------------------------------
def test_a_rank_sees_its_own_usage_counts_and_blocks() -> None:
    snap = rank_snapshot(ENGINE, "1")
    assert (snap.kv_usage, snap.running, snap.waiting) == (0.25, 3, 1)
    assert (snap.preemptions_total, snap.generation_tokens_total, snap.num_gpu_blocks) == (2.0, 500.0, 65)
    assert snap.ranks == {}


def test_a_rank_keeps_what_only_the_engine_says() -> None:
    snap = rank_snapshot(ENGINE, "1")
    assert (snap.taken_at, snap.ok, snap.has_metrics) == (5.0, True, True)
    assert (snap.block_size, snap.prefix_caching) == (16, True)


def test_a_rank_that_publishes_no_blocks_of_its_own_takes_the_engines() -> None:
    quiet = replace(ENGINE, ranks={"1": replace(RANK_1, num_gpu_blocks=None)})
    assert rank_snapshot(quiet, "1").num_gpu_blocks == 129


def test_a_rank_the_page_does_not_mention_knows_no_live_figures_but_keeps_the_capacity() -> None:
    snap = rank_snapshot(ENGINE, "7")
    assert (snap.kv_usage, snap.running, snap.waiting, snap.preemptions_total) == (None, None, None, None)
    assert (snap.num_gpu_blocks, snap.block_size, snap.ranks) == (129, 16, {})


# -- RecentPrefixes -------------------------------------------------------------------------------
def chain(*names: str) -> list[BlockKey]:
    """Stand-ins for a prompt's chained block keys: each key names its block and, through the chain, every block
    before it, so two prompts share a key only where they share every block up to it."""
    return [name.encode() for name in names]


@pytest.mark.parametrize(
    ("asked", "known"),
    [
        (chain("a", "b", "c", "d"), 3),  # the whole finished prompt, and one block past it
        (chain("a", "b"), 2),  # a shorter prompt with the same start
        (chain("a", "x", "y"), 1),  # diverges after the first block
        (chain("x", "y", "z"), 0),  # another first block: keys chain, so every key differs
        ([], 0),
    ],
    ids=["longer prompt", "shorter prompt", "diverging prompt", "other prompt", "no blocks"],
)
def test_recent_prefixes_count_the_longest_prefix_seen(asked: list[BlockKey], known: int) -> None:
    recent = RecentPrefixes()
    recent.add(chain("a", "b", "c"))
    assert recent.prefix(asked) == known


def test_recent_prefixes_forget_the_least_recent_keys_beyond_their_size() -> None:
    recent = RecentPrefixes(size=4)
    recent.add(chain("a", "b", "c"))
    recent.add(chain("d", "e"))
    assert recent.prefix(chain("a")) == 0  # the oldest key went first
    assert recent.prefix(chain("d", "e")) == 2
    assert recent.prefix(chain("b")) == 1 and recent.prefix(chain("c")) == 1


def test_a_prompt_seen_again_is_remembered_as_recent() -> None:
    recent = RecentPrefixes(size=3)
    recent.add(chain("a", "b", "c"))
    recent.add(chain("a"))  # finished again: now the most recent
    recent.add(chain("d"))
    assert [recent.prefix(chain(k)) for k in ("a", "b", "c", "d")] == [1, 0, 1, 1]


# -- SiteHeadroom ---------------------------------------------------------------------------------
class PoolHeadroom:
    """Keeps a fixed share of whatever budget it is asked about; records the budgets asked."""

    def __init__(self, share: float) -> None:
        self.share = share
        self.asked: list[int] = []

    def reserved(self, r: Any, budget: int) -> int:
        self.asked.append(budget)
        return int(self.share * budget)


@pytest.mark.parametrize(
    ("site_budget", "pool_budget", "room", "asked"),
    [
        (100, 100, 40, 100),  # one site: the plain headroom
        (25, 100, 10, 100),  # a quarter of the pool keeps a quarter of the pool's room
        (30, 100, 12, 100),  # 40 x 30 / 100 = 12
        (10, 30, 4, 30),  # 12 x 10 / 30 = 4
        (7, 30, 3, 30),  # 12 x 7 / 30 = 2.8: rounded up, the other tenants are never owed less
        (100, 0, 40, 100),  # no other site's budget known yet: the site's own
    ],
    ids=["one site", "a quarter", "thirty of a hundred", "a third", "rounded up", "pool unknown"],
)
def test_the_headroom_kept_over_the_pool_is_split_among_the_sites_by_budget(
    site_budget: int, pool_budget: int, room: int, asked: int
) -> None:
    pool = PoolHeadroom(0.4)
    split = SiteHeadroom(pool, lambda: pool_budget)
    assert split.reserved(object(), site_budget) == room
    assert pool.asked == [asked]


def test_with_one_site_the_split_headroom_is_the_plain_headroom() -> None:
    plain = PoolHeadroom(0.37)
    for budget in range(1, 200, 7):
        split = SiteHeadroom(PoolHeadroom(0.37), lambda budget=budget: budget)  # the pool is this one site
        assert split.reserved(object(), budget) == plain.reserved(object(), budget)
