"""The forecast: blocks freed per second of backlog, the expected wait, and which queued requests will miss their
deadline (with the margin, only once enough releases were seen, never while nothing runs)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gateway.admission.forecast import MIN_RELEASES, Forecast, ReleaseRate, speedup_margin
from tests.support.clock import FakeClock


@dataclass(frozen=True, eq=False)
class Item:
    name: str
    blocks: int
    priority: int = 0
    tenant: str = "default"
    weight: float = 1.0


def primed(releases: int, blocks: int = 4, every: float = 1.0, *, enabled: bool = True) -> tuple[Forecast, FakeClock]:
    """A forecast that saw ``releases`` releases of ``blocks`` blocks, one every ``every`` seconds of backlog:
    ``blocks / every`` blocks per second from the second release on. The queue timeout is 30 s."""
    clock = FakeClock(0.0)
    forecast = Forecast(enabled=enabled, timeout=30.0, clock=clock)
    forecast.observe(backlogged=True)
    for _ in range(releases):
        clock.now += every
        forecast.released(blocks)
    return forecast, clock


def backlog(*items: Item, deadline: float, lane: str = "", share: float = 1.0) -> list[tuple[str, float, Item, float]]:
    return [(lane, share, item, deadline) for item in items]


# -- the release rate ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("script", "expected"),
    [
        # (time, event): "on"/"off" the backlog, or a number of blocks released.
        pytest.param([(0, "on"), (1, 4), (2, 4), (3, 4)], (4.0, 3), id="blocks after the first per second"),
        pytest.param([(0, 4), (1, 4), (2, 4)], None, id="releases without a backlog are not counted"),
        pytest.param([(0, "on"), (1, 4)], None, id="one release makes no rate"),
        pytest.param([(0, "on"), (1, 4), (1, 4)], None, id="no time between releases makes no rate"),
        pytest.param(
            [(0, "on"), (0, 2), (5, 2), (10, 2), (10, "off"), (50, "on"), (55, 2)], (0.4, 4),
            id="time without a backlog is left out",
        ),
        pytest.param([(0, "on"), (0, 8), (1, 2), (2, 6)], (4.0, 3), id="sizes weigh, not counts"),
        pytest.param(
            [(0, "on"), (0, 9), (1, 9), (70, 1), (72, 1)], (0.5, 2), id="releases older than the window drop out"
        ),
        pytest.param(
            [(0, "on"), (0, 4), (1, 4), (2, 4), (2, "off"), (500, "on"), (501, 4)], (4.0, 4),
            id="an idle spell keeps the rate seen before it",
        ),
    ],
)
def test_the_release_rate_counts_blocks_per_second_of_backlog(
    script: list[tuple[float, str | int]], expected: tuple[float, int] | None
) -> None:
    rate = ReleaseRate(window=60.0)
    now = 0.0
    for now, event in script:
        if isinstance(event, str):
            rate.backlog(now, event == "on")
        else:
            rate.released(now, event)
    seen = rate.rate(now)
    if expected is None:
        assert seen is None
    else:
        assert seen is not None and seen[0] == pytest.approx(expected[0]) and seen[1] == expected[1]


@pytest.mark.parametrize(("releases", "margin"), [(6, 1.712), (16, 1.475), (64, 1.2875), (10_000, 1.115)])
def test_the_margin_narrows_as_releases_accumulate(releases: int, margin: float) -> None:
    assert speedup_margin(releases) == pytest.approx(margin, abs=1e-3)


# -- the expected wait -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("releases", "blocks", "free", "expected"),
    [
        pytest.param(MIN_RELEASES - 1, 40, 0, None, id="unknown before enough releases"),
        pytest.param(MIN_RELEASES, 40, 0, 10.0, id="blocks to free over the rate"),
        pytest.param(MIN_RELEASES, 40, 12, 7.0, id="what is free now counts"),
        pytest.param(MIN_RELEASES, 10, 12, 0.0, id="nothing to free: no wait"),
    ],
)
def test_the_expected_wait_is_the_blocks_to_free_over_the_rate(
    releases: int, blocks: int, free: int, expected: float | None
) -> None:
    forecast, _ = primed(releases)  # 4 blocks per second
    assert forecast.expected_wait(blocks, free) == expected


# -- which requests are late ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("releases", "enabled", "in_flight", "needs", "free", "late"),
    [
        # 4 blocks/s; with 36 releases the margin is 1.35x (5.4 blocks/s); deadlines 10 s away.
        pytest.param(36, True, 3, [30, 30], 0, ["b"], id="the second will not make it, the first will"),
        pytest.param(36, True, 3, [60], 0, ["a"], id="hopeless alone"),
        pytest.param(36, True, 3, [60], 12, [], id="what is free now lets it make it"),
        pytest.param(36, True, 3, [45], 0, [], id="beyond the wait seen but within the margin: kept"),
        pytest.param(36, True, 3, [60, 8], 0, ["a"], id="a refused request frees its place for those behind"),
        pytest.param(MIN_RELEASES - 1, True, 3, [80], 0, [], id="unknown rate: nobody is shed"),
        pytest.param(36, True, 0, [80], 0, [], id="nothing in flight: nobody is shed"),
        pytest.param(36, False, 3, [80], 0, [], id="switched off: nobody is shed"),
    ],
)
def test_late_requests_are_those_that_miss_their_deadline_even_at_the_margin(
    releases: int, enabled: bool, in_flight: int, needs: list[int], free: int, late: list[str]
) -> None:
    forecast, clock = primed(releases, enabled=enabled)
    items = [Item(name, need) for name, need in zip("abc", needs, strict=False)]
    found = forecast.late(backlog(*items, deadline=clock.now + 10.0), free, in_flight)
    assert [x.item.name for x in found] == late


@pytest.mark.parametrize(
    ("need", "late"),
    [
        pytest.param(45, ["b"], id="beyond the wait seen: refused as it arrives, though within the margin"),
        pytest.param(38, ["b"], id="within its deadline at the rate seen, past the share it must be within"),
        pytest.param(32, [], id="within the share of its time at the rate seen: queued"),
    ],
)
def test_the_arriving_request_is_judged_at_the_rate_seen_within_a_share_of_its_time(
    need: int, late: list[str]
) -> None:
    forecast, clock = primed(36)  # 4 blocks/s, 5.4 at the margin; 10 s to its deadline, 8 s of it to be admitted
    queued, arriving = Item("a", 10), Item("b", need)  # placed ahead of "a" (a shorter job first)
    found = forecast.late(backlog(arriving, queued, deadline=clock.now + 10.0), 0, 3, arriving=arriving)
    assert [x.item.name for x in found] == late
    assert all(x.arriving for x in found)


@pytest.mark.parametrize(
    ("overdue", "due", "order", "late"),
    [
        pytest.param({"a"}, 10.0, "behind", ["b"], id="behind a request past its objective's time: refused"),
        pytest.param(set(), 10.0, "behind", [], id="behind requests on time: queued"),
        pytest.param({"a"}, None, "behind", [], id="no objective judges it: queued"),
        pytest.param({"a"}, 10.0, "ahead", [], id="placed ahead of the late one: queued"),
    ],
)
def test_an_arrival_behind_a_request_its_objective_already_missed_is_refused_whatever_the_rate(
    overdue: set[str], due: float | None, order: str, late: list[str]
) -> None:
    """The rate seen says 2.5 s for the new request, well within its objective; but a request queued ahead of it is
    already past the time its objective gave it (the rate fell since): joining that queue only makes it later."""
    forecast, clock = primed(36)  # 4 blocks/s
    queued, arriving = Item("a", 4), Item("b", 6)
    items = (queued, arriving) if order == "behind" else (arriving, queued)
    found = forecast.late(
        backlog(*items, deadline=clock.now + 300.0), 0, 3, arriving=arriving,
        due=None if due is None else clock.now + due, overdue=lambda item: item.name in overdue,
    )
    assert [x.item.name for x in found] == late
    assert all(x.behind for x in found)


def test_the_same_request_once_queued_is_kept_at_the_margin() -> None:
    forecast, clock = primed(36)
    found = forecast.late(backlog(Item("b", 38), Item("a", 10), deadline=clock.now + 10.0), 0, 3)
    assert found == []


@pytest.mark.parametrize(("time_left", "late"), [(3.0, ["a"]), (2.9, [])])
def test_nobody_is_refused_in_the_last_tenth_of_the_timeout(time_left: float, late: list[str]) -> None:
    forecast, clock = primed(36)
    found = forecast.late(backlog(Item("a", 200), deadline=clock.now + time_left), 0, 3)
    assert [x.item.name for x in found] == late


def test_a_late_request_carries_the_figures_of_its_refusal() -> None:
    forecast, clock = primed(36)  # 4 blocks per second
    first, second = Item("a", 20), Item("b", 44)
    (late,) = forecast.late(backlog(first, second, deadline=clock.now + 10.0), free=4, in_flight=3)
    assert late.item is second
    assert (late.expected_wait, late.time_left, late.position, late.blocks_ahead) == (15.0, 10.0, 1, 20)
    assert (late.blocks_per_second, late.in_flight) == (4.0, 3)


def test_other_tenants_turns_count_against_a_lane() -> None:
    forecast, clock = primed(36)
    # Half the admissions go to this lane: its 20 blocks wait as 40 on the engine's turnover, 10 s at 4/s.
    one = Item("a", 20, tenant="t")
    assert forecast.late(backlog(one, deadline=clock.now + 7.0), 0, 3) == []
    (late,) = forecast.late(backlog(one, deadline=clock.now + 7.0, lane="t", share=0.5), 0, 3)
    assert (late.expected_wait, late.blocks_ahead) == (10.0, 20)


def test_status_tells_whether_the_forecast_is_ready() -> None:
    forecast, _ = primed(MIN_RELEASES - 1)
    assert forecast.status() == {"enabled": True, "blocks_freed_per_s": 4.0, "releases": 5, "ready": False}
    forecast.released(4)  # at the same instant: 20 blocks over the same 4 s
    assert forecast.status() == {"enabled": True, "blocks_freed_per_s": 5.0, "releases": 6, "ready": True}
