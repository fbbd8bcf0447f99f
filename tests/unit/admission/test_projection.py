"""The adaptive policy: admitting past the ledger on the projection, backing off, and falling back to the ledger."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from gateway.admission.lengths import OutputLengths
from gateway.admission.projection import Outlook, Projector, credited_progress, growth, project
from gateway.engine.live import never_scraped
from tests.unit.admission.rig import Rig, adaptive_rig_with_short_outputs, enter, release_all, settle, vllm_text


# -- adaptive, through the controller --------------------------------------------------------------
@pytest.mark.parametrize(("policy", "admitted"), [("strict", 0), ("adaptive", 5)])
async def test_adaptive_admits_past_the_ledger_when_requests_stop_early(policy: str, admitted: int) -> None:
    rig, running = await adaptive_rig_with_short_outputs(policy)
    extra = [rig.req(10) for _ in range(5)]
    tasks = [enter(r) for r in extra]
    await settle()
    assert sum(r.admitted for r in extra) == admitted
    status = rig.adm.status()
    assert status["output_lengths"] == {"/<=256": 8} and status["live_used_blocks"] == 10
    if policy == "adaptive":
        assert rig.adm.committed == 150
        assert status["admit_limit_blocks"] > status["budget_blocks"] == 100
    await release_all(rig, running + extra, tasks)


async def test_adaptive_backs_off_on_preemptions_past_the_budget_and_recovers_additively() -> None:
    rig, running = await adaptive_rig_with_short_outputs()
    for preemptions in (1, 2, 3, 4, 5):  # a preemption a second, 8 requests completed: past 1 per 100
        for r in running:
            r.observe_output_tokens(8 + preemptions)
        rig.clock.now += 1.0
        await rig.scrape(0.20, preemptions=preemptions)
    assert rig.adm.optimism == 0.0  # 1 -> 1/2 -> ... -> 1/32, below the floor: booked at the worst case
    extra = rig.req(10)
    task = enter(extra)
    await settle()
    # Each running request holds 2 blocks (8 + 13 tokens) and may grow by 8: 20 + 10 x 8 + 10 > 100.
    assert not extra.admitted
    for _ in range(5):
        rig.clock.now += 1.0
        for r in running:
            r.observe_output_tokens(16)
        await rig.scrape(0.20, preemptions=5)
    assert rig.adm.optimism == pytest.approx(0.25)
    await release_all(rig, [*running, extra], [task])


async def test_adaptive_trusts_only_the_ledger_when_metrics_go_stale() -> None:
    rig, running = await adaptive_rig_with_short_outputs()
    rig.clock.now += 2.5
    extra = rig.req(10)
    task = enter(extra)
    await settle()
    rig.adm.tick()
    assert not extra.admitted and rig.adm.status()["engine"]["stale"] is True
    rig.upstream.down = True
    await rig.view.refresh()  # type: ignore[union-attr]
    assert not extra.admitted
    rig.upstream.down = False
    for r in running:
        r.observe_output_tokens(9)
    rig.clock.now += 0.1
    await rig.scrape(0.10)
    assert extra.admitted  # fresh again
    await release_all(rig, [*running, extra], [task])


async def test_adaptive_without_engine_metrics_is_the_ledger() -> None:
    rig, running = await adaptive_rig_with_short_outputs()
    rig.upstream.text = vllm_text(0.1).replace("vllm:kv_cache_usage_perc", "other_usage")
    await rig.view.refresh()  # type: ignore[union-attr]
    extra = rig.req(10)
    task = enter(extra)
    await settle()
    assert not extra.admitted
    await release_all(rig, [*running, extra], [task])


@pytest.mark.parametrize(("progress", "admitted"), [(True, 4), (False, 4)])
async def test_adaptive_counts_in_flight_requests_at_their_expected_end(progress: bool, admitted: int) -> None:
    """Requests of a 152-token prompt allowed 168 tokens (20 blocks) stop after 8: five fill the ledger
    and hold 10 blocks each. Seen progressing, each may add 1 block on top of live usage (50 + 5 + 4 x 11
    <= 100). Not seen since the snapshot's window, it may be waiting or preempted, so live usage may not hold
    it; but the five together end at 5 x 11 = 55 blocks whatever they hold now (55 + 4 x 11 <= 100), so
    unknown progress no longer counts what a request holds twice."""
    rig = Rig(engine=True)
    await rig.scrape(0.0)
    for _ in range(8):
        async with rig.req(20, prompt=152) as done:
            done.observe_output_tokens(8)
    running = [await rig.req(20, prompt=152).__aenter__() for _ in range(5)]
    for r in running:
        r.observe_output_tokens(8)
    rig.clock.now += 0.1 if progress else 1.0
    await rig.scrape(0.50)
    extra = [rig.req(20, prompt=152) for _ in range(6)]
    tasks = [enter(r) for r in extra]
    await settle()
    assert sum(r.admitted for r in extra) == admitted
    await release_all(rig, running + extra, tasks)


# -- the projection on its own ------------------------------------------------------------------------
@dataclass
class Booked:
    """A request of a 152-token prompt allowed 168 tokens: 20 blocks of 16."""

    prompt_tokens: int = 152
    max_tokens: int = 168
    n: int = 1
    blocks: int = 20
    generated: int = 0
    credited: int | None = None
    credits: int = 0
    prefix_blocks: int = 0  # no prefix sharing: the projection as it was before sharing
    shared_blocks: int = 0
    keys: tuple[str, ...] = ()
    family: str = "m/chat"
    tenant: str = "default"

    def credit(self, taken_at: float, window: float) -> None:
        self.credits += 1
        self.credited = self.generated

    def forget_credit(self) -> None:
        self.credited = None


def stopped_at(*lengths: int) -> OutputLengths:
    """Answers of ``m/chat`` allowed 168 tokens that stopped at ``lengths``."""
    seen = OutputLengths()
    for tokens in lengths:
        seen.add("m/chat", "default", 168, tokens)
    return seen


EIGHT = stopped_at(*[8] * 8)  # eight answers of 8 tokens
SPREAD = stopped_at(4, 8, 8, 8, 40, 40, 40, 100, 100, 100)


@pytest.mark.parametrize(
    ("booked", "outlook", "grows"),
    [
        (Booked(), Outlook(1.0, EIGHT), 20),  # quantile 1: the worst case
        (Booked(), Outlook(0.7, None), 20),  # nothing learned: the worst case
        (Booked(), Outlook(0.7, OutputLengths()), 13),  # no samples: a quarter of max_tokens, 42: ceil(194 / 16)
        (Booked(), Outlook(0.7, EIGHT), 10),  # expected to stop after 8 tokens: ceil(160 / 16)
        (Booked(), Outlook(0.5, SPREAD), 12),  # the median of 4..100: 40 tokens, ceil(192 / 16)
        (Booked(), Outlook(0.9, SPREAD), 16),  # the 0.9 quantile: 100 tokens, ceil(252 / 16)
        (Booked(generated=8), Outlook(0.7, EIGHT), 11),  # past every length seen: 2 x 8, 168 tokens
        (Booked(generated=40), Outlook(0.7, EIGHT), 15),  # 2 x 40 generated: 232 tokens
        (Booked(generated=8), Outlook(0.5, SPREAD), 12),  # past 8: the median of the 6 longer ones, 40
        (Booked(generated=40), Outlook(0.5, SPREAD), 16),  # past 40: those of 100 are left
        (Booked(generated=8, credited=8), Outlook(0.7, EIGHT), 1),  # holds 10 already (152 + 8 tokens)
        (Booked(generated=8, credited=8), Outlook(1.0, EIGHT), 10),
    ],
)
def test_growth_is_the_expected_end_at_the_quantile_grown_past_what_was_generated(
    booked: Booked, outlook: Outlook, grows: int
) -> None:
    assert growth(booked, 16, outlook) == grows


def test_growth_without_credit_is_the_expected_final_size() -> None:
    credited = Booked(generated=8, credited=8)
    assert growth(credited, 16, Outlook(0.7, EIGHT), use_credit=False) == 11


def test_the_projection_keeps_the_smaller_of_its_two_bounds() -> None:
    outlook = Outlook(0.7, EIGHT)
    progressing = [Booked(generated=8, credited=8) for _ in range(5)]
    unknown = [Booked(generated=8) for _ in range(5)]
    # Seen progressing: live usage plus one block each; ends at 5 x 11 = 55 together.
    assert project(50, progressing, 16, outlook) == min(50 + 5 * 1, max(50, 5 * 11)) == 55
    # Progress unknown: on top of live usage they would count twice (50 + 55); their final sizes bound it.
    assert project(50, unknown, 16, outlook) == 55
    assert project(70, unknown, 16, outlook) == 70  # never below what the engine holds now
    assert project(0, [], 16, outlook) == 0


def sharer(prefix: str, shared: int, *, added: bool = False, credited: int | None = None) -> Booked:
    """The 20-block request above whose first ``shared`` prompt blocks are shared (``added``: it booked them)."""
    keys = tuple(f"{prefix}{i}" for i in range(shared))
    own = 20 - shared
    return Booked(
        blocks=own + (shared if added else 0), prefix_blocks=shared if added else 0, shared_blocks=shared, keys=keys,
        credited=credited,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("in_flight", "live", "shared_held", "projected"),
    [
        # The request that added the 9 shared blocks has ended; its two sharers were not seen running, and the
        # usage (from before they were scheduled) holds none of it: the shared blocks come on top (11 own each).
        ([sharer("a", 9), sharer("a", 9)], 0, 9, 0 + 11 + 11 + 9),
        # One sharer seen running (its prompt's tail block in use): the usage holds the shared blocks.
        ([sharer("a", 9, credited=0), sharer("a", 9)], 10, 9, 10 + 10 + 11),
        # The one that added them is in flight, not seen running: its own growth counts them.
        ([sharer("a", 9, added=True), sharer("a", 9)], 0, 9, 20 + 11),
        # Two prefixes, only the first held by a request seen running: the second's 5 blocks come on top.
        ([sharer("a", 9, credited=0), sharer("b", 5)], 10, 14, 10 + 10 + 15 + 5),
    ],
)
def test_shared_blocks_not_surely_in_the_live_usage_are_projected_on_top_of_it(
    in_flight: list[Booked], live: int, shared_held: int, projected: int
) -> None:
    assert project(live, in_flight, 16, Outlook(1.0, None), shared_held) == projected


def test_credited_progress_is_the_newest_checkpoint_in_the_window_less_what_runs_ahead() -> None:
    checkpoints = [(1.0, 10), (1.5, 20), (2.5, 30)]
    assert credited_progress(checkpoints, 2.0, 1.0, 1) == 20 - 4
    assert credited_progress(checkpoints, 3.0, 1.0, 2) == 30 - 6
    assert credited_progress(checkpoints, 2.0, 0.4, 1) is None  # nothing seen shortly before
    assert credited_progress([(1.0, 3)], 1.0, 1.0, 1) == 0


def test_the_projector_credits_progress_on_good_snapshots_and_forgets_it_on_bad_ones() -> None:
    projector = Projector(credit_window=0.5)
    good = replace(never_scraped(1.0), ok=True, has_metrics=True, preemptions_total=0.0)
    running = [Booked(generated=8)]
    projector.observe(never_scraped(0.0), good, running)
    assert running[0].credited == 8 and running[0].credits == 1
    projector.observe(good, replace(good, taken_at=2.0, preemptions_total=3.0), running)
    assert projector.optimism.value == 0.5
    projector.observe(good, never_scraped(3.0), running)
    assert running[0].credited is None and projector.optimism.value == 0.5
    assert projector.outlook() == Outlook(0.85, projector.outputs)
