"""The authority's side of one worker's channel: requests held by the worker's keys (never the client's id), each
charged to its tenant and each released; a worker gone gives back every reservation it held and takes its
streams out of the engine's view."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.engine.progress import ProgressDetector
from gateway.tenants import Grant
from gateway.workers.authority import Authority, WorkerLink
from gateway.workers.messages import (
    Access,
    Admit,
    Admitted,
    Booking,
    Charge,
    End,
    Message,
    Progress,
    Release,
    Withdraw,
)
from tests.unit.workers.transport import Counts, Transport, frames


class Booked:
    """A reservation as the grant enters it: held between entering and leaving, released once."""

    def __init__(self, request_id: str, asked: dict[str, Any] | None = None) -> None:
        self.request_id = request_id
        self.asked = asked or {}  # what the authority asked its admission for
        self.target = None
        self.queue_ms = 0.0
        self.held = False
        self.released: bool | None = None  # completed, once released
        self.generated = 0
        self.first: list[float | None] = []  # the first-token times it was told with its counts

    async def __aenter__(self) -> Booked:
        self.held = True
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.held = False

    def observe_output_tokens(self, generated: int, first_token_s: float | None = None) -> None:
        self.generated = max(self.generated, generated)
        self.first.append(first_token_s)

    def sent(self) -> None:
        pass

    def release(self, *, completed: bool = True) -> None:
        if self.released is None:
            self.released = completed
        self.held = False


class Tenants:
    def __init__(self) -> None:
        self.charged: list[Charge] = []
        self.usage = SimpleNamespace(rejected=lambda tenant, reason: None)

    async def check(self, tenant: str, *, prompt_tokens: int, output_tokens: int) -> Grant:
        self.charged.append(Charge(tenant, prompt_tokens, output_tokens))
        return Grant.unlimited()


@pytest.fixture
async def world() -> SimpleNamespace:
    booked: list[Booked] = []

    def reservation(**kw: Any) -> Booked:
        booked.append(Booked(kw["request_id"], kw))
        return booked[-1]

    progress = ProgressDetector(15.0)
    engine = SimpleNamespace(progress=progress, fingerprint=SimpleNamespace(learn=lambda value: None))
    tenants = Tenants()
    written: list[str] = []
    parts = SimpleNamespace(
        admission=SimpleNamespace(reservation=reservation, budget_blocks=lambda: None),
        tenants=tenants, every_engine=lambda: [engine], access_log=SimpleNamespace(write_lines=written.append),
    )
    authority = Authority(parts, Path("/nonexistent"))  # type: ignore[arg-type]
    authority.counts = Counts()  # type: ignore[assignment]
    link = WorkerLink(parts, authority)  # type: ignore[arg-type]
    authority.links.add(link)
    wire = Transport()
    link.channel.connection_made(wire)  # type: ignore[arg-type]
    return SimpleNamespace(link=link, wire=wire, booked=booked, tenants=tenants, progress=progress, written=written)


def booking(rid: str, deadline: float | None = None, objective: float | None = None) -> Booking:
    return Booking(rid, 16, 32, 1, 0, "search", 1.0, None, (), "tiny/completions", deadline, objective, 0)


def receive(world: SimpleNamespace, *messages: Message) -> None:
    world.link.channel.data_received(frames(*messages))


async def turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


ENDS = {
    "released-then-ended": lambda key, completed, generated: [Release(key, completed, generated), End(key, 0.0)],
    "ended-with-its-release-folded-in": lambda key, completed, generated: [End(key, 0.0, (completed, generated, None))],
}


@pytest.mark.parametrize("ends", [pytest.param(v, id=k) for k, v in ENDS.items()])
async def test_two_requests_with_one_client_id_are_each_charged_held_and_released(
    world: SimpleNamespace, ends: Any
) -> None:
    charge = Charge("search", 16, 32)
    receive(world, Admit(1, booking("retry-1"), charge), Admit(2, booking("retry-1"), charge))
    await turns()
    assert [b.held for b in world.booked] == [True, True] and [b.request_id for b in world.booked] == ["retry-1"] * 2
    assert world.tenants.charged == [charge, charge]
    assert [(m.key, type(m)) for m in world.wire.sent()] == [(1, Admitted), (2, Admitted)]
    receive(world, *ends(1, True, 30), *ends(2, False, 3))
    await turns()
    assert [b.released for b in world.booked] == [True, False] and not any(b.held for b in world.booked)
    assert [b.generated for b in world.booked] == [30, 3]
    assert world.link.requests == {}


FIRST_TOKEN_TOLD = {
    "by-its-progress": [Progress({1: 1}, {}, {}, {1: 0.25}), Release(1, True, 9), End(1, 0.0)],
    "by-its-release": [Release(1, True, 1, 0.25), End(1, 0.0)],
    "by-its-end-with-the-release-folded-in": [End(1, 0.0, (True, 1, 0.25))],
}


@pytest.mark.parametrize("messages", [pytest.param(v, id=k) for k, v in FIRST_TOKEN_TOLD.items()])
async def test_a_first_token_timed_by_the_worker_reaches_the_reservation_with_the_count(
    world: SimpleNamespace, messages: list[Message]
) -> None:
    receive(world, Admit(1, booking("r"), None))
    await turns()
    receive(world, *messages)
    await turns()
    assert world.booked[0].first[0] == 0.25 and all(first is None for first in world.booked[0].first[1:])


async def test_a_workers_request_is_booked_with_its_deadline_and_its_own_objective(world: SimpleNamespace) -> None:
    receive(world, Admit(1, booking("r", deadline=30.0, objective=0.8), None))
    await turns()
    asked = world.booked[0].asked
    assert (asked["deadline"], asked["objective"], asked["family"]) == (30.0, 0.8, "tiny/completions")
    receive(world, Release(1, True, 0), End(1, 0.0))
    await turns()


async def test_a_withdrawn_request_gives_its_reservation_back(world: SimpleNamespace) -> None:
    receive(world, Admit(1, booking("r"), None))
    await turns()
    receive(world, Withdraw(1), End(1, 0.0))
    await turns()
    assert not world.booked[0].held and world.link.requests == {}


async def test_a_worker_gone_gives_back_every_reservation_it_held(world: SimpleNamespace) -> None:
    receive(world, *(Admit(key, booking("same"), None) for key in (1, 2, 3)))
    await turns()
    assert all(b.held for b in world.booked)
    world.link.channel.connection_lost(None)
    await turns()
    assert not any(b.held for b in world.booked) and world.link.requests == {}
    assert world.link not in world.link.authority.links


async def test_a_worker_gone_takes_its_streams_out_of_the_engines_view(world: SimpleNamespace) -> None:
    progress: ProgressDetector = world.progress
    progress.opened()  # the authority's own stream
    receive(world, Progress({}, {0: (3, 10, 0)}, {}, {}), Progress({}, {0: (-1, 4, 1)}, {}, {}))
    assert progress.in_flight == 3
    world.link.channel.connection_lost(None)
    assert progress.in_flight == 1
    progress.closed()
    assert progress.in_flight == 0 and not progress.has_work()  # idle: judged and probed no more


async def test_a_workers_access_log_lines_are_written_here_as_the_worker_formatted_them(world: SimpleNamespace) -> None:
    receive(world, Access("request_id=a status=200\nrequest_id=b status=429\n"), Access("request_id=c status=200\n"))
    assert world.written == ["request_id=a status=200\nrequest_id=b status=429\n", "request_id=c status=200\n"]
