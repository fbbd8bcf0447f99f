"""The admission controller with the headroom for active tenants: a quiet tenant finds room beside a flood."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.admission import Reservation
from gateway.admission.headroom import ACTIVE_WINDOW_S
from tests.unit.admission.rig import BS, Rig, enter, release_all, settle

BUDGET = 32
FLOOD = 8  # blocks per flood request: four fill the budget


def rig(**flags: Any) -> Rig:
    flags.setdefault("admission_policy", "strict")
    flags.setdefault("queue_timeout", 10 * ACTIVE_WINDOW_S)  # the window passes before any deadline
    return Rig(kv_blocks=BUDGET, **flags)


def req(r: Rig, tenant: str, blocks: int) -> Reservation:
    return r.adm.reservation(prompt_tokens=8, max_tokens=blocks * BS - 8, n=1, priority=0, request_id=tenant,
                             tenant=tenant)


async def quiet_once(r: Rig, blocks: int = 1) -> None:
    """The quiet tenant sends one request, answered at once: it is active for a window."""
    async with req(r, "quiet", blocks):
        pass


async def flood(r: Rig, count: int) -> tuple[list[Reservation], list[asyncio.Task[Reservation]]]:
    reservations = [req(r, "flood", FLOOD) for _ in range(count)]
    tasks = [enter(x) for x in reservations]
    await settle()
    return reservations, tasks


@pytest.mark.parametrize(
    ("flags", "flood_holds", "flood_ends_first"),
    [
        ({}, 3 * FLOOD, 0),  # the default: room kept for the quiet tenant's one block
        ({"tenant_headroom": "off"}, BUDGET, 1),  # the flood takes it all: the quiet request waits for one to end
        ({"fair_queueing": "off"}, BUDGET, 3),  # FIFO, no headroom: it waits behind the two queued flood requests
    ],
)
async def test_a_quiet_tenant_is_admitted_at_once_beside_a_flood(
    flags: dict[str, str], flood_holds: int, flood_ends_first: int
) -> None:
    r = rig(**flags)
    await quiet_once(r)
    reservations, tasks = await flood(r, 6)
    assert r.adm.committed == flood_holds
    quiet = req(r, "quiet", 1)
    waiting = enter(quiet)
    await settle()
    ended = 0
    while not quiet.admitted:
        reservations[ended].release()
        ended += 1
        await settle()
    assert ended == flood_ends_first
    await release_all(r, [*reservations, quiet], [*tasks, waiting])


async def test_a_lone_tenant_uses_the_whole_budget() -> None:
    r = rig()
    reservations, tasks = await flood(r, 6)
    assert (r.adm.committed, r.adm.in_flight, r.adm.queued) == (BUDGET, 4, 2)
    assert r.adm.status()["tenants"]["flood"]["headroom_blocks"] == 0
    await release_all(r, reservations, tasks)


async def test_the_room_goes_back_to_the_flood_once_the_quiet_tenant_stops_sending() -> None:
    r = rig()
    await quiet_once(r)
    reservations, tasks = await flood(r, 6)
    status = r.adm.status()
    assert status["tenant_headroom"] is True
    assert status["tenants"]["quiet"] == {
        "weight": 1.0, "counter": status["tenants"]["quiet"]["counter"], "queued": 0,
        "active": True, "held_blocks": 0, "demand_blocks": 1, "headroom_blocks": 1,
    }
    r.adm.publish()
    assert r.count("vllm_guard_tenant_headroom_blocks", tenant="quiet") == 1
    r.clock.now += ACTIVE_WINDOW_S + 1
    reservations[0].release()  # the next re-examination of the queue finds the quiet tenant idle
    await settle()
    assert r.adm.committed == BUDGET
    assert r.adm.status()["tenants"]["quiet"]["active"] is False
    r.adm.publish()
    assert r.count("vllm_guard_tenant_headroom_blocks", tenant="quiet") == 0
    await release_all(r, reservations, tasks)


async def test_a_request_larger_than_its_fair_share_is_not_held_back_for_ever() -> None:
    r = rig()
    async with req(r, "quiet", 8), req(r, "quiet", 8):
        pass  # the quiet tenant held half the budget at once: its demand, and its fair share
    large = req(r, "flood", 24)
    assert r.adm.status()["tenants"]["quiet"]["headroom_blocks"] == 0  # the flood is not active yet
    # 24 blocks and the quiet tenant's 16 do not fit together: the room kept shrinks to what the request leaves.
    async with large:
        assert r.adm.committed == 24
        quiet = await req(r, "quiet", 8).__aenter__()  # and the quiet tenant still finds its 8
        assert r.adm.committed == BUDGET
        quiet.release()
    r.assert_drained()


async def test_behind_its_own_tenants_requests_a_large_request_waits_only_for_them() -> None:
    r = rig()
    await quiet_once(r, 16)
    small = await req(r, "flood", 8).__aenter__()
    large = req(r, "flood", 24)
    waiting = enter(large)
    await settle()
    assert not large.admitted  # 8 + 24 and room for the quiet tenant: over the budget
    small.release()
    await settle()
    assert large.admitted  # its own tenant holds nothing more: the quiet tenant's room shrinks to 8
    await release_all(r, [large], [waiting])
