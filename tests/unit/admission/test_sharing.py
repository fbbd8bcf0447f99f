"""Admission with prefix sharing: prompt blocks held by requests in flight are booked once, freed with their last
holder; a request's ``n`` sequences share their prompt; the engine's prefix caching switches it on; traffic that
bypasses the gateway is seen and not held against it."""

from __future__ import annotations

import pytest

from gateway import errors
from gateway.admission import Reservation
from gateway.admission.prefix import PromptPrefix, block_keys
from tests.unit.admission.rig import BS, Rig, enter, release_all, settle

PREFIX = list(range(3, 163))  # 160 tokens: 10 full blocks of 16


def prompt(tail: int, length: int = 161) -> PromptPrefix:
    """A prompt of ``length`` tokens starting with the shared 160-token prefix; ``tail`` varies its end."""
    return PromptPrefix(PREFIX[: min(length, 160)] + [400 + tail] * max(0, length - 160), "m\0")


def req(rig: Rig, prefix: PromptPrefix | None, *, max_tokens: int = 15, n: int = 1, priority: int = 0) -> Reservation:
    length = len(prefix.ids) if prefix is not None else 161
    return rig.adm.reservation(prompt_tokens=length, max_tokens=max_tokens, n=n, priority=priority,
                               request_id=f"r{id(prefix)}-{n}-{max_tokens}", prefix=prefix)


def sharing_rig(**flags: object) -> Rig:
    return Rig(kv_blocks=40, block_size=BS, admission_policy="strict", prefix_sharing="on", **flags)  # type: ignore[arg-type]


async def test_requests_with_one_prefix_book_its_blocks_once() -> None:
    rig = sharing_rig()
    a = await req(rig, prompt(1)).__aenter__()  # 161 + 15 tokens = 11 blocks, 10 of them shareable
    b = await req(rig, prompt(2)).__aenter__()
    assert (a.blocks, b.blocks) == (11, 1)
    assert rig.adm.committed == 12
    sharing = rig.adm.status()["prefix_sharing"]
    assert sharing["logical_committed_blocks"] == 22 and sharing["physical_committed_blocks"] == 12
    assert sharing["shared_blocks_held"] == 10 and sharing["sharing_ratio"] == pytest.approx(22 / 12, abs=1e-3)
    assert rig.count("vllm_guard_kv_shared_blocks") == 10
    assert rig.count("vllm_guard_kv_logical_committed_blocks") == 22
    a.release()
    assert rig.adm.committed == 11  # the prefix stays booked while b holds it
    b.release()
    rig.assert_drained()


async def test_the_n_sequences_of_one_request_share_their_prompt_blocks() -> None:
    rig = sharing_rig()
    r = await req(rig, prompt(1), n=4).__aenter__()
    assert r.blocks == 10 + 4 * 1 and r.logical_blocks == 44
    r.release()
    rig.assert_drained()


async def test_without_sharing_every_request_books_its_whole_prompt() -> None:
    rig = Rig(kv_blocks=40, block_size=BS, admission_policy="strict", prefix_sharing="off")
    a = await req(rig, prompt(1)).__aenter__()
    b = await req(rig, prompt(2)).__aenter__()
    assert rig.adm.committed == 22 and rig.adm.status()["prefix_sharing"]["on"] is False
    for r in (a, b):
        r.release()
    rig.assert_drained()


async def test_sharing_fits_a_request_the_budget_would_refuse_without_it() -> None:
    rig = sharing_rig()
    assert rig.adm.fit(161, 15, 4, clamp=False, prefix_known=True) == 15  # 14 blocks of 40
    with pytest.raises(errors.KVBudgetExceeded):
        rig.adm.fit(161, 15, 4, clamp=False, prefix_known=False)  # 44 blocks
    # Clamped with sharing: (40 - 10) // 4 + 10 = 17 blocks per sequence, 272 tokens, 111 of them output.
    assert rig.adm.fit(161, 500, 4, clamp=True, prefix_known=True) == 17 * BS - 161


async def test_a_queued_request_whose_prefix_is_held_passes_a_larger_head() -> None:
    rig = sharing_rig(starvation_bound=1)
    holder = await req(rig, prompt(1)).__aenter__()  # 11 blocks
    filler = await req(rig, None, max_tokens=270).__aenter__()  # unshared: 27 blocks -> 38 of 40 committed
    big = req(rig, None, max_tokens=300)  # needs 29: waits at the head
    big_task = enter(big)
    stranger = req(rig, PromptPrefix([7] * 150, "m\0"))  # another prefix: 11 blocks, cannot pass
    stranger_task = enter(stranger)
    sharer = req(rig, prompt(2))  # 1 block beyond the prefix the holder keeps
    sharer_task = enter(sharer)
    await settle()
    assert sharer.admitted and sharer.blocks == 1 and rig.adm.committed == 39
    assert not big.admitted and not stranger.admitted
    late = req(rig, prompt(4))  # the head has been passed as often as the bound allows: it waits too
    late_task = enter(late)
    await settle()
    assert not late.admitted
    tasks = [big_task, stranger_task, sharer_task, late_task]
    await release_all(rig, [holder, filler, sharer, big, stranger, late], tasks)


async def test_with_auto_sharing_follows_the_engines_prefix_caching_and_recounts_what_is_in_flight() -> None:
    rig = Rig(engine=True, admission_policy="strict")
    await rig.scrape(0.0, blocks=40, prefix_caching=True)
    a = await req(rig, prompt(1)).__aenter__()
    b = await req(rig, prompt(2)).__aenter__()
    assert rig.adm.sharing and rig.adm.committed == 12
    await rig.scrape(0.0, blocks=40, prefix_caching=False)  # restarted without prefix caching
    assert not rig.adm.sharing and rig.adm.committed == 22
    await rig.scrape(0.0, blocks=40, prefix_caching=True)
    assert rig.adm.committed == 12
    for r in (a, b):
        r.release()
    rig.assert_drained()


async def test_an_engine_that_does_not_say_gets_no_sharing_under_auto() -> None:
    rig = Rig(engine=True, admission_policy="strict")
    await rig.scrape(0.0, blocks=40)
    assert not rig.adm.sharing


async def test_traffic_that_bypasses_the_gateway_is_shown_and_its_preemptions_keep_the_optimism() -> None:
    rig = Rig(engine=True)
    await rig.scrape(0.0, blocks=40, running=0)
    mine = await req(rig, prompt(1), n=2).__aenter__()
    await rig.scrape(0.3, preemptions=0, blocks=40, running=2)
    assert rig.adm.status()["foreign_sequences"] == 0
    await rig.scrape(0.9, preemptions=3, blocks=40, running=3, waiting=4)  # 5 sequences not the gateway's
    assert rig.adm.status()["foreign_sequences"] == 5 and rig.adm.optimism == 1.0
    assert rig.count("vllm_guard_engine_foreign_sequences") == 5
    assert rig.count("vllm_guard_engine_foreign_preemptions_total") == 3
    await rig.scrape(0.9, preemptions=5, blocks=40, running=2)  # only the gateway's own: its preemptions count
    assert rig.adm.optimism == 0.5
    mine.release()
    rig.assert_drained()


async def test_a_long_prompts_keys_are_hashed_off_the_loop_and_book_the_same() -> None:
    rig = Rig(kv_blocks=4000, block_size=BS, admission_policy="strict", prefix_sharing="on")
    ids = [(i * 31) % 500 for i in range(8192)]
    first = rig.adm.reservation(prompt_tokens=8192, max_tokens=16, n=1, priority=0, request_id="long-1",
                                prefix=PromptPrefix(ids, "m\0"))
    async with first:  # entering hashes its 511 keys in a worker thread
        assert first.keys == block_keys(PromptPrefix(ids, "m\0"), BS)
        second = await req(rig, PromptPrefix(ids[:4000] + [1] * 10, "m\0")).__aenter__()
        assert len(first.keys) == 511 and first.blocks == 511 + 2
        assert second.prefix_blocks == 0  # its 249 shareable blocks are among the long prompt's
        second.release()
    rig.assert_drained()
