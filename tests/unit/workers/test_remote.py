"""A worker's side of the channel: each request named by a key of the worker's making, whatever id its client
sent; its tenant charged once; every wait on the authority bounded, and withdrawn when given up or left."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.config import Settings
from gateway.errors import QueueFull, UpstreamUnavailable
from gateway.workers import remote
from gateway.workers.liveness import CODE
from gateway.workers.messages import (
    Admit,
    Admitted,
    End,
    Message,
    Progress,
    Refused,
    Release,
    Withdraw,
    error_data,
)
from gateway.workers.remote import AuthorityClient, RemoteAdmission, RemoteGrant, RemoteReservation
from tests.unit.workers.transport import Transport


@pytest.fixture
def wire() -> Transport:
    return Transport()


@pytest.fixture
async def client(wire: Transport) -> AuthorityClient:
    parts = SimpleNamespace(every_engine=lambda: [])
    made = AuthorityClient(parts, Settings(queue_timeout=0.5))  # type: ignore[arg-type]
    made.channel.connection_made(wire)  # type: ignore[arg-type]
    return made


def booked(client: AuthorityClient, rid: str = "retry-1", **extra: Any) -> RemoteReservation:
    return RemoteAdmission(client, client.settings).reservation(
        prompt_tokens=16, max_tokens=32, request_id=rid, tenant="search", **extra
    )


def grant(client: AuthorityClient) -> RemoteGrant:
    return RemoteGrant(client, remote.Charge("search", 16, 32))


async def sent(wire: Transport) -> list[Message]:
    for _ in range(3):  # a task started, then the channel's write (once per loop turn)
        await asyncio.sleep(0)
    return wire.sent()


def answer(client: AuthorityClient, message: Message) -> None:
    client.channel.data_received(b"")  # heard from
    client._on_message(message)


async def test_two_requests_with_one_client_id_are_two_keys_on_the_channel(
    client: AuthorityClient, wire: Transport
) -> None:
    grants = [grant(client), grant(client)]
    holds = [g.admit(booked(client, "retry-1"), lambda: None) for g in grants]
    entering = [asyncio.create_task(h.__aenter__()) for h in holds]
    admits = await sent(wire)
    assert [type(m) for m in admits] == [Admit, Admit]
    keys = [m.key for m in admits if isinstance(m, Admit)]
    assert len(set(keys)) == 2 and [m.booking.request_id for m in admits if isinstance(m, Admit)] == ["retry-1"] * 2
    for key in keys:
        answer(client, Admitted(key, 0.0, {}, None))
    await asyncio.gather(*entering)
    for hold, g in zip(holds, grants, strict=True):
        await hold.__aexit__(None, None, None)
        g.settle(1.0)
    assert await sent(wire) == [End(keys[0], 1.0, (False, 0, None)), End(keys[1], 1.0, (False, 0, None))]


async def admitted_hold(client: AuthorityClient, wire: Transport) -> tuple[RemoteGrant, RemoteReservation, Any]:
    g, reservation = grant(client), booked(client)
    hold = g.admit(reservation, lambda: None)
    entering = asyncio.create_task(hold.__aenter__())
    await sent(wire)
    answer(client, Admitted(g.key, 0.0, {}, None))
    await entering
    return g, reservation, hold


@pytest.mark.parametrize(("turns_between", "expected"), [
    pytest.param(0, lambda key: [End(key, 2.0, (True, 7, None))], id="ended-in-the-same-turn-one-frame"),
    pytest.param(3, lambda key: [Release(key, True, 7), End(key, 2.0, None)], id="ended-turns-later-two-frames"),
])
async def test_a_release_rides_in_its_requests_end_when_both_leave_in_one_write(
    client: AuthorityClient, wire: Transport, turns_between: int, expected: Any
) -> None:
    g, reservation, hold = await admitted_hold(client, wire)
    reservation.observe_output_tokens(7)
    reservation.release(completed=True)
    for _ in range(turns_between):  # the release's write went out meanwhile (a stream whose client still reads)
        await asyncio.sleep(0)
    await hold.__aexit__(None, None, None)
    g.settle(2.0)
    assert [m for m in await sent(wire) if not isinstance(m, Progress)] == expected(g.key)


async def test_a_release_held_for_the_write_goes_out_with_it_when_no_end_comes(
    client: AuthorityClient, wire: Transport
) -> None:
    g, _, hold = await admitted_hold(client, wire)
    await hold.__aexit__(None, None, None)  # released (not completed); the request goes on
    assert await sent(wire) == [Release(g.key, False, 0)]
    g.settle(0.5)
    assert await sent(wire) == [End(g.key, 0.5, None)]


async def test_the_charge_rides_until_the_authority_has_seen_the_request(
    client: AuthorityClient, wire: Transport
) -> None:
    g = grant(client)
    for attempt in range(2):  # a failover admits the same request again: charged once
        hold = g.admit(booked(client), lambda: None)
        entering = asyncio.create_task(hold.__aenter__())
        *released, admit = await sent(wire)
        assert released == ([Release(g.key, False, 0)] if attempt else [])
        assert isinstance(admit, Admit) and admit.key == g.key
        assert (admit.charge is not None) is (attempt == 0)
        answer(client, Admitted(g.key, 0.0, {}, None))
        await entering
        await hold.__aexit__(None, None, None)


async def test_the_admit_carries_the_requests_deadline_and_its_own_objective(
    client: AuthorityClient, wire: Transport
) -> None:
    g = grant(client)
    entering = asyncio.create_task(g.admit(booked(client, deadline=20.0, objective=0.8), lambda: None).__aenter__())
    (admit,) = await sent(wire)
    assert isinstance(admit, Admit) and (admit.booking.deadline, admit.booking.objective) == (20.0, 0.8)
    answer(client, Admitted(g.key, 0.0, {}, None))
    await entering


async def test_a_refusal_is_raised_as_the_authoritys_error(client: AuthorityClient, wire: Transport) -> None:
    g = grant(client)
    entering = asyncio.create_task(g.admit(booked(client), lambda: None).__aenter__())
    await sent(wire)
    answer(client, Refused(g.key, error_data(QueueFull("The queue is full.", retry_after=3.0)), {"x-r": "1"}))
    with pytest.raises(QueueFull):
        await entering
    assert g.headers == {"x-r": "1"}


async def test_a_silent_authority_is_not_asked_and_the_request_refused_at_once(
    client: AuthorityClient, wire: Transport
) -> None:
    client.liveness.silent_since = 0.0
    g = grant(client)
    with pytest.raises(UpstreamUnavailable) as refused:
        await g.admit(booked(client), lambda: None).__aenter__()
    assert refused.value.code == CODE and refused.value.retry_after is not None
    g.settle(0.0)
    assert await sent(wire) == []  # nothing for the authority to free or settle


@pytest.mark.parametrize("silent", [True, False], ids=["silent", "heard from"])
async def test_a_wait_on_the_authority_is_bounded_and_withdrawn_when_given_up(
    client: AuthorityClient, wire: Transport, monkeypatch: pytest.MonkeyPatch, silent: bool
) -> None:
    monkeypatch.setattr(remote, "ANSWER_GRACE", 0.1)
    g = grant(client)
    entering = asyncio.create_task(g.admit(booked(client, deadline=0.3), lambda: None).__aenter__())
    await sent(wire)
    if silent:
        client.liveness.silent_since = 0.0
    started = asyncio.get_running_loop().time()
    with pytest.raises(UpstreamUnavailable) as gave_up:
        await entering
    waited = asyncio.get_running_loop().time() - started
    # Its own limit (the deadline, 0.3 s, below --queue-timeout) and the grace; twice the limit while heard from.
    assert (0.3 <= waited < 0.6) if silent else (0.6 <= waited < 1.2)
    assert gave_up.value.code == CODE and gave_up.value.retry_after is not None
    assert await sent(wire) == [Withdraw(g.key)]


async def test_a_request_waiting_when_the_authority_falls_silent_is_refused_then_and_withdrawn(
    client: AuthorityClient, wire: Transport
) -> None:
    g = grant(client)
    entering = asyncio.create_task(g.admit(booked(client), lambda: None).__aenter__())  # --queue-timeout's wait
    await sent(wire)
    loop = asyncio.get_running_loop()
    client.channel.heard_at = loop.time() - 60.0  # nothing heard for a minute
    client.liveness.tick()
    client.liveness.tick()  # the second tick is on time: the silence is the authority's
    with pytest.raises(UpstreamUnavailable) as refused:
        await asyncio.wait_for(entering, 1.0)
    assert refused.value.code == CODE and refused.value.retry_after is not None
    assert await sent(wire) == [Withdraw(g.key)]


async def test_a_client_that_leaves_while_it_waits_is_withdrawn(client: AuthorityClient, wire: Transport) -> None:
    g = grant(client)
    entering = asyncio.create_task(g.admit(booked(client), lambda: None).__aenter__())
    await sent(wire)
    entering.cancel()
    with pytest.raises(asyncio.CancelledError):
        await entering
    assert await sent(wire) == [Withdraw(g.key)]


async def test_losing_the_authority_fails_every_waiter_at_once(client: AuthorityClient, wire: Transport) -> None:
    entering = [asyncio.create_task(grant(client).admit(booked(client), lambda: None).__aenter__()) for _ in "ab"]
    await sent(wire)
    client.channel.connection_lost(None)
    for waiter in entering:
        with pytest.raises(UpstreamUnavailable, match="lost its admission authority"):
            await waiter


async def test_progress_is_told_by_key(client: AuthorityClient, wire: Transport) -> None:
    g = grant(client)
    reservation = booked(client)
    hold = g.admit(reservation, lambda: None)
    entering = asyncio.create_task(hold.__aenter__())
    await sent(wire)
    answer(client, Admitted(g.key, 0.0, {}, None))
    await entering
    reservation.observe_output_tokens(12)
    client.flush()
    assert await sent(wire) == [Progress({g.key: 12}, {}, {}, {})]


@pytest.mark.parametrize(("told_by", "expected"), [
    pytest.param("progress", lambda key: [Progress({key: 1}, {}, {}, {key: 0.25}), Release(key, True, 9)],
                 id="a-stream-tells-it-with-its-first-progress"),
    pytest.param("release", lambda key: [Release(key, True, 9, 0.25)],
                 id="a-release-before-any-progress-carries-it"),
])
async def test_a_worker_times_a_first_token_from_its_own_write_to_the_engine(
    client: AuthorityClient, wire: Transport, told_by: str, expected: Any
) -> None:
    now = [100.0]
    client.clock = lambda: now[0]
    g, reservation, _ = await admitted_hold(client, wire)
    now[0] += 5.0  # the gateway's own time after the admission: not the engine's
    reservation.sent()
    now[0] += 0.25
    reservation.observe_output_tokens(1)
    if told_by == "progress":
        client.flush()
    now[0] += 1.0
    reservation.observe_output_tokens(9)  # later counts carry no time
    reservation.release(completed=True)
    client.flush()
    got = [m for m in await sent(wire) if not (isinstance(m, Progress) and not m.first)]
    assert got == expected(g.key)


async def test_a_whole_answer_of_several_tokens_a_choice_is_no_first_token_sample(
    client: AuthorityClient, wire: Transport
) -> None:
    g, reservation, _ = await admitted_hold(client, wire)
    reservation.sent()
    reservation.observe_output_tokens(7)  # n = 1: seven tokens at once are a whole answer
    reservation.release(completed=True)
    assert await sent(wire) == [Release(g.key, True, 7)]
