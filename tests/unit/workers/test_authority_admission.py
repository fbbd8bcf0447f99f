"""The authority admits a worker's request on the real admission without a task of its own: admitted as it arrives,
it is held by nothing but the worker's messages, and every way a request can end gives its blocks back; a request
that must queue, or whose tenant has a per-minute window, still waits, is charged and is refused as in one process."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.engine.progress import ProgressDetector
from gateway.metrics import Metrics
from gateway.tenants import Tenants
from gateway.workers.authority import Authority, WorkerLink
from gateway.workers.messages import (
    Admit,
    Admitted,
    Booking,
    Charge,
    End,
    Message,
    Refused,
    Release,
    Withdraw,
)
from tests.unit.admission.rig import Rig
from tests.unit.workers.transport import Counts, Transport, frames

KEYS = """\
tenants:
  search:
    limits: {requests_per_minute: 2}
    keys: [sk-search-0f3c9a]
"""


@pytest.fixture
async def world(tmp_path: Path) -> SimpleNamespace:
    rig = Rig()  # 10 blocks of 16 tokens: three requests of 3 blocks fit, a fourth queues
    keys = tmp_path / "keys.yaml"
    keys.write_text(KEYS, encoding="utf-8")
    tenants = Tenants(rig.settings.model_copy(update={"keys_file": str(keys)}), Metrics())
    engine = SimpleNamespace(progress=ProgressDetector(15.0), fingerprint=SimpleNamespace(learn=lambda value: None))
    parts = SimpleNamespace(admission=rig.adm, tenants=tenants, every_engine=lambda: [engine],
                            access_log=SimpleNamespace(write_lines=lambda lines: None))
    authority = Authority(parts, Path("/nonexistent"))  # type: ignore[arg-type]
    authority.counts = Counts()  # type: ignore[assignment]
    link = WorkerLink(parts, authority)  # type: ignore[arg-type]
    wire = Transport()
    link.channel.connection_made(wire)  # type: ignore[arg-type]
    return SimpleNamespace(link=link, wire=wire, adm=rig.adm, tenants=tenants)


def booking(rid: str, max_tokens: int = 32, tenant: str = "default") -> Booking:
    return Booking(rid, 16, max_tokens, 1, 0, tenant, 1.0, None, (), "tiny/chat", None, None, 0)


def receive(world: SimpleNamespace, *messages: Message) -> None:
    world.link.channel.data_received(frames(*messages))


async def sent(world: SimpleNamespace) -> list[Any]:
    """What the authority answered since the last look, once the loop has turned (its writes go out then)."""
    for _ in range(5):
        await asyncio.sleep(0)
    return world.wire.sent()  # type: ignore[no-any-return]


async def answers(world: SimpleNamespace) -> list[tuple[int, type]]:
    return [(m.key, type(m)) for m in await sent(world)]


async def test_a_request_that_fits_is_admitted_as_it_arrives_and_held_by_no_task(world: SimpleNamespace) -> None:
    receive(world, Admit(1, booking("a"), None))
    assert world.adm.committed == 3 and world.adm.in_flight == 1  # before any turn of the loop
    assert not world.link._tasks
    assert await answers(world) == [(1, Admitted)]
    receive(world, Release(1, True, 20), End(1, 0.0))
    assert world.adm.committed == 0 and world.link.requests == {}


async def test_a_request_that_must_queue_is_admitted_when_blocks_come_back(world: SimpleNamespace) -> None:
    receive(world, *(Admit(key, booking(f"r{key}"), None) for key in (1, 2, 3, 4)))
    assert await answers(world) == [(1, Admitted), (2, Admitted), (3, Admitted)]
    assert world.adm.queued == 1 and len(world.link._tasks) == 1
    receive(world, Release(2, True, 32), End(2, 0.0))
    assert await answers(world) == [(4, Admitted)]
    assert world.adm.queued == 0 and world.adm.in_flight == 3 and not world.link._tasks


def withdraw(world: SimpleNamespace, keys: list[int]) -> None:
    receive(world, *(Withdraw(key) for key in keys))


def end_unreleased(world: SimpleNamespace, keys: list[int]) -> None:
    receive(world, *(End(key, 0.0) for key in keys))


def worker_gone(world: SimpleNamespace, keys: list[int]) -> None:
    world.link.channel.connection_lost(None)


@pytest.mark.parametrize("how", [withdraw, end_unreleased, worker_gone], ids=lambda f: f.__name__)
async def test_every_way_a_request_ends_gives_its_blocks_back_admitted_or_queued(
    world: SimpleNamespace, how: Callable[[SimpleNamespace, list[int]], None]
) -> None:
    receive(world, *(Admit(key, booking(f"r{key}"), None) for key in (1, 2, 3, 4, 5)))
    await answers(world)
    assert (world.adm.in_flight, world.adm.queued) == (3, 2)
    how(world, [1, 2, 3, 4, 5])
    await answers(world)
    assert (world.adm.committed, world.adm.in_flight, world.adm.queued) == (0, 0, 0)
    assert not world.link._tasks


async def test_a_request_admitted_again_gives_back_what_its_first_admission_held(world: SimpleNamespace) -> None:
    receive(world, Admit(1, booking("a"), None))
    receive(world, Admit(1, booking("a"), None))  # its engine failed under it: admitted again, elsewhere
    assert await answers(world) == [(1, Admitted), (1, Admitted)]
    assert world.adm.in_flight == 1 and world.adm.committed == 3


async def test_a_request_that_can_never_fit_is_refused_with_the_limit_and_nothing_is_held(
    world: SimpleNamespace,
) -> None:
    receive(world, Admit(1, booking("huge", max_tokens=10_000), None))
    [refused] = await sent(world)
    assert isinstance(refused, Refused) and refused.error is not None and refused.error.name == "KVBudgetExceeded"
    assert world.adm.committed == 0 and world.adm.queued == 0


async def test_a_tenants_window_is_charged_here_once_per_request_and_refuses_past_its_limit(
    world: SimpleNamespace,
) -> None:
    charge = Charge("search", 16, 32)
    receive(world, *(Admit(key, booking(f"r{key}", tenant="search"), charge) for key in (1, 2, 3)))
    answered = await sent(world)
    assert [(m.key, type(m)) for m in answered] == [(1, Admitted), (2, Admitted), (3, Refused)]
    assert answered[0].headers["x-ratelimit-limit-requests"] == "2"
    assert answered[2].error.name == "TenantRateLimited"
    receive(world, Admit(1, booking("r1", tenant="search"), None))  # a failover: the same request, not charged
    assert await answers(world) == [(1, Admitted)]
    assert world.adm.in_flight == 2
