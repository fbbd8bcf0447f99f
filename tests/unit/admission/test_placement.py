"""Where a request goes among several engines: the site that holds or lately held the longest prefix of its prompt
first, then the one with the most room; engines that are down, hung or unlike the first are passed over while
another can take the request, and the engine a request failed on is avoided. A data-parallel engine becomes one
site per rank once its metrics show the ranks and nothing is in flight on it, and one site again without them."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from gateway.admission.headroom import Headroom
from gateway.admission.placement import Sites
from gateway.admission.prefix import PromptPrefix
from gateway.admission.reservation import Reservation
from gateway.admission.site import Site
from gateway.config import Settings
from gateway.engine.live import EngineView
from gateway.metrics import Metrics
from tests.support.clock import FakeClock, ManualSleep
from tests.unit.admission.rig import BS, Upstream, vllm_text

PREFIX = list(range(3, 163))  # 160 tokens: 10 full blocks of 16


class NoAdmitter:
    """Placement only reads reservations: nothing enters or leaves."""

    async def enter(self, reservation: Reservation) -> None:
        raise AssertionError("placement does not admit")

    def leave(self, reservation: Reservation) -> None:
        raise AssertionError("placement does not release")


def rank_text(blocks: Sequence[int], block_size: int = BS) -> str:
    """A data-parallel engine's page: each rank's series under its ``engine`` label."""
    lines = []
    total = sum(count + 1 for count in blocks)  # vLLM labels every engine with the engines' sum
    for rank, count in enumerate(blocks):
        tokens = (count + 1) * block_size  # and with its own tokens
        lines += [
            f'vllm:kv_cache_usage_perc{{engine="{rank}"}} 0.0',
            f'vllm:num_requests_running{{engine="{rank}"}} 0',
            f'vllm:num_requests_waiting{{engine="{rank}"}} 0',
            f'vllm:cache_config_info{{block_size="{block_size}",engine="{rank}",kv_cache_size_tokens="{tokens}",'
            f'num_gpu_blocks="{total}"}} 1.0',
        ]
    return "\n".join(lines) + "\n"


class Pool:
    """Sites over scripted engines, each with its own page; ``usable`` lists the engines that may take requests."""

    def __init__(self, engines: int, **flags: object) -> None:
        flags.setdefault("prefix_sharing", "on")
        self.settings = Settings(kv_target=1.0, admission_policy="strict", **flags)  # type: ignore[arg-type]
        self.clock = FakeClock()
        self.upstreams = [Upstream() for _ in range(engines)]
        self.views = [
            EngineView(up, interval=0.25, stale_after=2.0, metrics=Metrics(), clock=self.clock, sleep=ManualSleep())
            for up in self.upstreams
        ]
        self.usable = set(range(engines))
        self.sites = Sites(self.settings, self.views, Headroom(enabled=False), usable=lambda i: i in self.usable)
        self._ids = 0

    async def page(self, engine: int, text: str) -> None:
        self.upstreams[engine].text = text
        await self.views[engine].refresh()

    async def scrape(self, *blocks: int, block_size: int = BS, prefix_caching: bool | None = None) -> None:
        for engine, count in enumerate(blocks):
            await self.page(engine, vllm_text(0.0, blocks=count, block_size=block_size, prefix_caching=prefix_caching))

    def req(
        self, prompt: list[int] | None = None, *, max_tokens: int = 15, avoid: frozenset[str] = frozenset(),
        sharing: bool = True,
    ) -> Reservation:
        self._ids += 1
        ids = prompt if prompt is not None else [500 + self._ids] * 161
        r = Reservation(
            NoAdmitter(), prompt_tokens=len(ids), max_tokens=max_tokens, n=1, priority=0, request_id=f"r{self._ids}",
            block_size=BS, clock=self.clock, checkpoint_spacing=0.1, prefix=PromptPrefix(ids, "m\0"), avoid=avoid,
        )
        r.recount(BS, sharing)  # as admission does on entry: the keys of its shareable prompt blocks
        return r

    def hold(self, name: str, r: Reservation) -> None:
        """``r`` admitted on site ``name``: on its books and in flight there."""
        site = self.site(name)
        site.books.commit(r)
        site.in_flight.add(r)

    def site(self, name: str) -> Site:
        return next(s for s in self.sites if s.name == name)

    def order(self, r: Reservation, *, block_size: int = BS, sharing: bool = True) -> list[str]:
        return [s.name for s in self.sites.candidates(r, block_size, sharing)]

    def names(self) -> list[str]:
        return [s.name for s in self.sites]


def shares(blocks: int) -> list[int]:
    """A 161-token prompt whose first ``blocks`` blocks are the common prefix's."""
    return PREFIX[: blocks * BS] + [900] * (161 - blocks * BS)


# -- order ----------------------------------------------------------------------------------------
async def test_sites_are_tried_most_free_blocks_first() -> None:
    pool = Pool(3)
    await pool.scrape(100, 200, 150)
    assert pool.order(pool.req()) == ["1", "2", "0"]
    pool.hold("1", pool.req(max_tokens=16 * 120))  # engine 1 now has the least room left
    assert pool.order(pool.req()) == ["2", "0", "1"]


@pytest.mark.parametrize(
    ("placed", "order"),
    [
        ({}, ["1", "0"]),
        ({"0": ("held", 10)}, ["0", "1"]),
        ({"0": ("finished", 10)}, ["0", "1"]),
        ({"0": ("held", 3), "1": ("finished", 6)}, ["1", "0"]),
        ({"0": ("finished", 8), "1": ("held", 2)}, ["0", "1"]),
        ({"0": ("held", 5), "1": ("held", 5)}, ["1", "0"]),
    ],
    ids=[
        "no prefix anywhere: most room first", "a held prefix beats more room", "a finished prefix beats more room",
        "the longer prefix wins", "a longer finished prefix beats a shorter held one", "equal prefixes: most room",
    ],
)
async def test_the_site_with_the_longest_prefix_of_the_prompt_comes_first(
    placed: dict[str, tuple[str, int]], order: list[str]
) -> None:
    pool = Pool(2)
    await pool.scrape(100, 200)
    for name, (how, blocks) in placed.items():
        earlier = pool.req(shares(blocks))
        if how == "held":
            pool.hold(name, earlier)
        else:
            pool.site(name).recent.add(earlier.keys)
    assert pool.order(pool.req(shares(10))) == order


async def test_without_prefix_keys_affinity_plays_no_part() -> None:
    pool = Pool(2)
    await pool.scrape(100, 200)
    pool.site("0").recent.add(pool.req(shares(10)).keys)
    assert pool.order(pool.req(shares(10), sharing=False)) == ["1", "0"]


# -- which sites may take it ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("usable", "order"),
    [
        ({0, 1, 2}, ["1", "2", "0"]),
        ({0, 2}, ["2", "0"]),
        ({0}, ["0"]),
        (set(), []),
    ],
    ids=["all up", "one down", "only the smallest up", "none up: none (what is queued waits for one)"],
)
async def test_engines_that_cannot_take_requests_are_skipped_while_another_can(
    usable: set[int], order: list[str]
) -> None:
    pool = Pool(3)
    await pool.scrape(100, 200, 150)
    pool.usable = usable
    assert pool.order(pool.req()) == order


@pytest.mark.parametrize(("usable", "order"), [({0}, ["0"]), (set(), [])], ids=["up", "down, hung or unhealthy"])
async def test_a_lone_engine_that_takes_no_request_is_given_none(usable: set[int], order: list[str]) -> None:
    """What /health says of the engine, admission follows: a request queued before the engine was seen down or
    hung is not sent into it (it was, with one engine, before)."""
    pool = Pool(1)
    await pool.scrape(100)
    pool.usable = usable
    assert pool.order(pool.req()) == order


@pytest.mark.parametrize(
    ("pages", "order"),
    [
        ([(16, True), (16, True)], ["1", "0"]),
        ([(16, True), (32, True)], ["0"]),
        ([(16, True), (16, False)], ["0"]),
        ([(16, True), (16, None)], ["0"]),
        ([(32, False), (32, False)], ["1", "0"]),
    ],
    ids=[
        "alike", "another block size", "prefix caching off", "prefix caching unsaid",
        "none like the pool: every site",
    ],
)
async def test_engines_unlike_the_pool_are_skipped_while_another_can_take_it(
    pages: list[tuple[int, bool | None]], order: list[str]
) -> None:
    pool = Pool(2, prefix_sharing="auto")
    for engine, ((block_size, caching), blocks) in enumerate(zip(pages, (100, 200), strict=True)):
        await pool.page(engine, vllm_text(0.0, blocks=blocks, block_size=block_size, prefix_caching=caching))
    assert pool.order(pool.req(), block_size=BS, sharing=True) == order


@pytest.mark.parametrize(
    ("avoid", "order"),
    [
        ({"1"}, ["2", "0"]),
        ({"1", "2"}, ["0"]),
        ({"0", "1", "2"}, ["1", "2", "0"]),
        ({"9"}, ["1", "2", "0"]),
    ],
    ids=["the failed engine", "two failed engines", "every engine failed: any", "an unknown name"],
)
async def test_a_request_avoids_the_engines_it_failed_on(avoid: set[str], order: list[str]) -> None:
    pool = Pool(3)
    await pool.scrape(100, 200, 150)
    assert pool.order(pool.req(avoid=frozenset(avoid))) == order


async def test_a_single_site_takes_everything_whatever_its_block_size_caching_or_the_request_avoids() -> None:
    pool = Pool(1, prefix_sharing="auto")
    await pool.scrape(100, block_size=32, prefix_caching=False)
    assert pool.order(pool.req(avoid=frozenset({"0"})), block_size=BS, sharing=True) == ["0"]


# -- data-parallel ranks ----------------------------------------------------------------------------
async def test_a_data_parallel_engine_is_split_into_one_site_per_rank() -> None:
    pool = Pool(2)
    await pool.scrape(100)
    await pool.page(1, rank_text([40, 60]))
    assert pool.sites.follow_ranks(1, pool.views[1].snapshot) is True
    assert pool.names() == ["0", "1.0", "1.1"]
    assert [(s.target.engine, s.target.rank) for s in pool.sites] == [(0, None), (1, 0), (1, 1)]
    assert [cap.blocks for _, cap in pool.sites.capacities()] == [100, 40, 60]  # each rank its own cache
    assert pool.sites.budget_total() == 200
    assert pool.sites.follow_ranks(1, pool.views[1].snapshot) is False  # already split


async def test_ranks_are_split_only_once_nothing_is_in_flight_on_the_engine() -> None:
    pool = Pool(2)
    await pool.scrape(100, 100)
    running = pool.req()
    pool.hold("1", running)
    await pool.page(1, rank_text([50, 50]))
    assert pool.sites.follow_ranks(1, pool.views[1].snapshot) is False
    assert pool.names() == ["0", "1"]
    pool.site("1").in_flight.discard(running)
    assert pool.sites.follow_ranks(1, pool.views[1].snapshot) is True
    assert pool.names() == ["0", "1.0", "1.1"]


async def test_ranks_merge_back_into_one_site_when_the_engine_returns_without_them() -> None:
    pool = Pool(2)
    await pool.scrape(100)
    await pool.page(1, rank_text([50, 50]))
    pool.sites.follow_ranks(1, pool.views[1].snapshot)
    running = pool.req()
    pool.hold("1.1", running)
    await pool.page(1, vllm_text(0.0, blocks=80))
    assert pool.sites.follow_ranks(1, pool.views[1].snapshot) is False  # a rank still runs a request
    pool.site("1.1").in_flight.discard(running)
    assert pool.sites.follow_ranks(1, pool.views[1].snapshot) is True
    assert pool.names() == ["0", "1"]
    assert [cap.blocks for _, cap in pool.sites.capacities()] == [100, 80]


@pytest.mark.parametrize(
    "text",
    [
        rank_text([50]),
        rank_text([50]).replace('engine="0"', 'engine="a"') + rank_text([50]).replace('engine="0"', 'engine="b"'),
    ],
    ids=["one rank", "labels that are no ranks"],
)
async def test_an_engine_without_ranks_to_follow_stays_one_site(text: str) -> None:
    pool = Pool(1)
    await pool.page(0, text)
    assert pool.sites.follow_ranks(0, pool.views[0].snapshot) is False
    assert pool.names() == ["0"]


async def test_a_failed_scrape_keeps_the_ranks_of_an_idle_engine() -> None:
    pool = Pool(1)
    await pool.page(0, rank_text([50, 50]))
    pool.sites.follow_ranks(0, pool.views[0].snapshot)
    pool.upstreams[0].down = True
    await pool.views[0].refresh()
    pool.sites.follow_ranks(0, pool.views[0].snapshot)
    assert pool.names() == ["0.0", "0.1"]  # an outage says nothing of the ranks: they come back as they were
