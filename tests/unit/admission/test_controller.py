"""The controller: the strict ledger, concurrency, the whole budget, capacity from the engine, status and gauges."""

from __future__ import annotations

import asyncio
import random

import pytest

from gateway import errors
from gateway.http.errors import error_headers, status_and_type
from tests.unit.admission.rig import Rig, adaptive_rig_with_short_outputs, enter, settle, vllm_text


# -- strict ledger ---------------------------------------------------------------------------------
async def test_strict_admits_while_the_ledger_fits_and_queues_the_rest() -> None:
    rig = Rig(admission_policy="strict")
    a, b, c = rig.req(6), rig.req(4), rig.req(1)
    await a.__aenter__()
    await b.__aenter__()
    waiting = enter(c)
    await settle()
    assert (rig.adm.committed, rig.adm.queued, c.admitted) == (10, 1, False)
    a.release()
    await waiting
    assert c.admitted and rig.adm.committed == 5
    assert rig.count("vllm_guard_admissions_total", how="queued") == 1
    assert rig.count("vllm_guard_admissions_total", how="immediate") == 2
    b.release()
    c.release()
    rig.assert_drained()


@pytest.mark.parametrize("policy", ["strict", "adaptive"])
async def test_the_ledger_never_exceeds_the_target_without_live_metrics(policy: str) -> None:
    rig = Rig(admission_policy=policy, kv_blocks=100, kv_target=0.9)
    rng = random.Random(7)
    requests = [rig.req(rng.randint(1, 40), priority=rng.randint(0, 2)) for _ in range(60)]
    tasks = [enter(r) for r in requests]
    peak = 0
    while not all(t.done() for t in tasks):
        await settle()
        assert rig.adm.committed <= 90
        peak = max(peak, rig.adm.committed)
        admitted = [r for r in requests if r.admitted]
        rng.choice(admitted).release()
    for r in requests:
        r.release()
    assert peak > 60  # the budget was really used, not just respected
    rig.assert_drained()


@pytest.mark.parametrize("policy", ["strict", "adaptive"])
@pytest.mark.parametrize("flags", [{"engine_watermark": 0.05}, {"managed": True, "model": "m",
                                                                 "vllm_args": ["--watermark", "0.05"]}])
async def test_beside_requests_in_flight_admission_keeps_the_engines_watermark_free(
    policy: str, flags: dict[str, object]
) -> None:
    """vLLM with --watermark 0.05 admits a request beside running ones only while 5 of 100 blocks stay free after
    it; a request alone may use them all. Booked past that, a request would wait in vLLM's own queue."""
    rig = Rig(admission_policy=policy, kv_blocks=100, **flags)
    alone = await rig.req(98).__aenter__()  # alone: the whole cache
    alone.release()
    first = await rig.req(90).__aenter__()
    second = await rig.req(5).__aenter__()  # 95 of 100: the watermark's 5 stay free
    third = enter(rig.req(1))
    await settle()
    assert (rig.adm.committed, rig.adm.queued) == (95, 1)
    second.release()
    (await third).release()
    first.release()
    rig.assert_drained()


async def test_without_a_watermark_admission_books_the_whole_cache() -> None:
    rig = Rig(kv_blocks=100)
    held = [await rig.req(90).__aenter__(), await rig.req(10).__aenter__()]
    assert rig.adm.committed == 100
    for r in held:
        r.release()
    rig.assert_drained()


# -- concurrency, idle -----------------------------------------------------------------------------
async def test_max_concurrency_holds_whatever_the_budget() -> None:
    rig = Rig(max_concurrency=2, kv_blocks=1000)
    first, second = await rig.req(1).__aenter__(), await rig.req(1).__aenter__()
    third = enter(rig.req(1))
    await settle()
    assert (rig.adm.in_flight, rig.adm.queued) == (2, 1)
    first.release()
    (await third).release()
    second.release()
    rig.assert_drained()


async def test_without_capacity_only_concurrency_limits() -> None:
    rig = Rig(max_concurrency=2, kv_blocks=None, kv_tokens=None)
    assert rig.adm.fit(10_000, 50_000, 4, clamp=True) == 50_000
    huge = await rig.req(10_000).__aenter__()
    other = await rig.req(10_000).__aenter__()
    third = enter(rig.req(1))
    await settle()
    assert rig.adm.queued == 1
    huge.release()
    (await third).release()
    other.release()
    rig.assert_drained()


async def test_wait_idle_reports_when_in_flight_reaches_zero() -> None:
    rig = Rig()
    assert await rig.adm.wait_idle(1.0)
    r = await rig.req(1).__aenter__()
    idle = asyncio.create_task(rig.adm.wait_idle(30.0))
    await settle()
    assert not idle.done()
    r.release()
    assert await idle
    r2 = await rig.req(1).__aenter__()
    timed_out = asyncio.create_task(rig.adm.wait_idle(30.0))
    await settle()
    assert rig.sleep.delays[-1] == 30.0
    rig.sleep.wake()
    assert await timed_out is False
    r2.release()
    rig.assert_drained()


# -- the whole budget: fit and oversize requests ---------------------------------------------------
@pytest.mark.parametrize(
    ("prompt", "max_tokens", "n", "clamp", "fitted"),
    [
        (100, 60, 1, True, 60),  # 160 tokens = 10 blocks: fits as it is
        (100, 100, 1, True, 60),  # lowered to what the budget leaves
        (30, 100, 2, True, 50),  # 5 blocks per sequence
        (100, 100, 1, False, None),
        (100, 100, 2, True, None),  # two prompts alone fill the budget
        (160, 10, 1, True, None),
    ],
)
async def test_fit_clamps_or_refuses_what_exceeds_the_whole_budget(
    prompt: int, max_tokens: int, n: int, clamp: bool, fitted: int | None
) -> None:
    rig = Rig()
    if fitted is not None:
        assert rig.adm.fit(prompt, max_tokens, n, clamp=clamp) == fitted
        return
    with pytest.raises(errors.KVBudgetExceeded) as caught:
        rig.adm.fit(prompt, max_tokens, n, clamp=clamp)
    assert status_and_type(caught.value)[0] == 400 and "retry-after" not in error_headers(caught.value)
    assert f"({prompt} prompt + {max_tokens} max_tokens)" in caught.value.message
    assert "KV budget of 10 blocks (160 tokens = kv_target 1 x 10 blocks)" in caught.value.message


async def test_a_reservation_larger_than_the_budget_is_refused_not_queued() -> None:
    rig = Rig()
    with pytest.raises(errors.KVBudgetExceeded, match="needs 11 KV blocks"):
        await rig.req(11).__aenter__()
    rig.assert_drained()


# -- capacity from the engine ----------------------------------------------------------------------
async def test_needs_are_recounted_when_the_engine_publishes_its_block_size() -> None:
    rig = Rig(engine=True)
    r = await rig.adm.reservation(prompt_tokens=100, max_tokens=156, n=1, priority=0, request_id="a").__aenter__()
    assert (r.blocks, rig.adm.committed) == (16, 16)  # counted in the default 16-token blocks
    rig.upstream.text = vllm_text(0.1, blocks=32, block_size=128)
    await rig.view.refresh()  # type: ignore[union-attr]
    assert (r.blocks, rig.adm.committed, rig.adm.status()["block_size"]) == (2, 2, 128)
    r.release()
    rig.assert_drained()


async def test_a_queued_request_that_no_longer_fits_a_shrunk_engine_is_refused() -> None:
    rig = Rig(engine=True, admission_policy="strict")
    await rig.scrape(0.0, blocks=100)
    holder = await rig.req(60).__aenter__()
    waiting = enter(rig.req(50))
    await settle()
    await rig.scrape(0.0, blocks=40)
    with pytest.raises(errors.KVBudgetExceeded, match="budget of 40 blocks"):
        await waiting
    holder.release()
    rig.assert_drained()


# -- observability ---------------------------------------------------------------------------------
async def test_status_and_gauges_describe_the_ledger() -> None:
    rig = Rig(kv_blocks=20, kv_target=0.5, max_queue=3)
    holder = await rig.req(10).__aenter__()
    waiting = enter(rig.req(2, priority=3))
    await settle()
    status = rig.adm.status()
    expected = {
        "policy": "adaptive", "paused": False, "block_size": 16, "capacity_blocks": 20, "capacity_source": "flags",
        "budget_blocks": 10, "committed_blocks": 10, "live_used_blocks": None, "admit_limit_blocks": 10,
        "in_flight": 1, "queued": 1, "queued_by_priority": {"3": 1}, "max_queue": 3, "engine": None,
    }
    assert {k: status[k] for k in expected} == expected
    assert rig.count("vllm_guard_kv_committed_blocks") == 10
    assert rig.count("vllm_guard_kv_budget_blocks") == 10
    assert rig.count("vllm_guard_queue_depth", priority="3") == 1
    holder.release()
    (await waiting).release()
    assert rig.adm.status()["drain_rate_per_s"] == 2.0
    # The committed gauge follows every release, without waiting for a status read or a snapshot.
    assert rig.count("vllm_guard_kv_committed_blocks") == 0
    rig.assert_drained()


def samples(rig: Rig) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in rig.metrics.registry.collect()
        for s in family.samples
    }


async def test_status_is_a_pure_read() -> None:
    rig, running = await adaptive_rig_with_short_outputs("strict")
    waiting = enter(rig.req(60))
    await settle()
    rig.clock.now += 30.0  # past the queue timeout and the metrics' freshness, with nobody looking
    before = samples(rig)
    first, second = rig.adm.status(), rig.adm.status()
    assert first == second and samples(rig) == before
    assert first["queued"] == 1 and first["engine"]["stale"] is True  # not expired, not re-examined
    assert first["projected_blocks"] is None and first["admit_limit_blocks"] == 100  # the ledger alone decides
    rig.adm.tick()
    with pytest.raises(errors.QueueTimeout):
        await waiting
    for r in running:
        r.release()
    rig.assert_drained()


async def test_publish_exports_the_freshness_and_the_limit_as_of_now() -> None:
    rig, running = await adaptive_rig_with_short_outputs()
    assert rig.count("vllm_guard_engine_metrics_stale") == 0
    assert rig.count("vllm_guard_kv_admit_limit_blocks") > rig.count("vllm_guard_kv_budget_blocks") == 100
    assert rig.count("vllm_guard_kv_live_used_blocks") == 10
    rig.clock.now += 2.5  # the engine stopped answering: no snapshot says so
    rig.adm.status()
    assert rig.sample("vllm_guard_engine_metrics_stale") == 0
    rig.adm.publish()  # what /metrics does
    assert rig.sample("vllm_guard_engine_metrics_stale") == 1
    assert rig.count("vllm_guard_engine_metrics_age_seconds") == pytest.approx(2.5)
    assert rig.count("vllm_guard_kv_admit_limit_blocks") == 100  # stale: the ledger's limit
    for r in running:
        r.release()
    rig.assert_drained()


async def test_the_committed_and_queue_gauges_follow_every_change() -> None:
    rig = Rig(kv_blocks=20, kv_target=0.5)
    assert (rig.count("vllm_guard_kv_capacity_blocks"), rig.count("vllm_guard_kv_budget_blocks")) == (20, 10)
    holder = await rig.req(8).__aenter__()
    assert rig.count("vllm_guard_kv_committed_blocks") == 8
    waiting = [enter(rig.req(4, priority=p)) for p in (1, 1, 2)]
    await settle()
    assert [rig.count("vllm_guard_queue_depth", priority=p) for p in ("1", "2")] == [2, 1]
    waiting[2].cancel()
    await asyncio.gather(waiting[2], return_exceptions=True)
    assert rig.count("vllm_guard_queue_depth", priority="2") == 0
    holder.release()
    await settle()
    assert rig.count("vllm_guard_kv_committed_blocks") == 8
    assert rig.count("vllm_guard_queue_depth", priority="1") == 0
    for t in waiting[:2]:
        (await t).release()
    assert rig.count("vllm_guard_kv_committed_blocks") == 0
    rig.assert_drained()

