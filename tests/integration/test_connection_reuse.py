"""One kept-alive connection through refusals: a request the gateway refuses at admission (503 ``deadline``, 429
``queue_full``) or in validation (400) is answered in OpenAI's shape on the connection it came on, which then
serves the next request. Admission refuses only after the whole body is read, and without ``connection: close``:
a client pool may reuse the connection at once (the refusals of an overload are no cause of closed connections).

A gateway whose loop runs late (busy, as under an overload) must not close, at its idle deadline, a connection
on which a request came in time and waits unread: uvloop, which ``vllm-guard serve`` runs on, runs the timers
already due before it reads, and the client's request met a reset (aiohttp's ``Can not write request body`` or
``Server disconnected``, the OpenAI SDK's ``APIConnectionError``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import uvloop

from testing.gateway_thread import GatewayServer
from testing.hostile_checks import RawResponse, close_writer, host_port, read_response, request_bytes
from testing.vllm_sim import SimServer
from tests.integration import test_admission_flood as flood_rig
from tests.integration.test_admission_flood import HOLDER, QUEUE_RIG, WAITER, completion, eventually, held_reservation

exits, make_sim, make_gateway = flood_rig.exits, flood_rig.make_sim, flood_rig.make_gateway


class Connection:
    """One client connection, requests sent on it one after another."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def post(self, body: dict[str, Any], headers: dict[str, str] | None = None) -> RawResponse:
        data = json.dumps(body).encode()
        self.writer.write(request_bytes("POST", "/v1/completions",
                                        {"content-type": "application/json", **(headers or {})}, data))
        answer = await asyncio.wait_for(read_response(self.reader), 10)
        assert answer is not None, "the gateway closed the connection instead of answering"
        return answer


def refused(answer: RawResponse, status: int, code: str) -> None:
    assert answer.status == status, answer.body[:300]
    error = json.loads(answer.body)["error"]
    assert error["code"] == code, error
    assert answer.headers.get("connection") != "close", answer.headers


async def test_refusals_leave_a_kept_alive_connection_usable(
    make_sim: Callable[..., SimServer], make_gateway: Callable[..., GatewayServer]
) -> None:
    sim = make_sim(**QUEUE_RIG)
    gw = make_gateway(sim, admission_policy="strict", kv_target=1.0, max_queue=1, queue_timeout=30.0)
    conn = Connection(*await asyncio.open_connection(*host_port(gw.url)))
    try:
        async with httpx.AsyncClient(timeout=10.0) as client:
            async with held_reservation(client, gw, sim, *HOLDER):
                refused(await conn.post(completion(*WAITER), {"x-guard-deadline-ms": "200"}), 503, "deadline")
                # Another client's request holds the queue's one place.
                waiting = asyncio.create_task(client.post(gw.url + "/v1/completions", json=completion(*WAITER)))
                await eventually(lambda: gw.status()["queued"] == 1, "one request queued")
                refused(await conn.post(completion(*WAITER)), 429, "queue_full")
                refused(await conn.post(completion(600, 8)), 400, "context_length_exceeded")
            assert (await waiting).status_code == 200
        served = await conn.post(completion(16, 8))
        assert served.status == 200, served.body[:300]
    finally:
        await close_writer(conn.writer)


IDLE = 2.0  # --keep-alive-timeout; the request below is sent 0.8 s before it, while the gateway is held up


@contextlib.contextmanager
def holding(gw: GatewayServer, seconds: float) -> Iterator[Callable[[], None]]:
    """``hold()`` holds the gateway's loop up for ``seconds`` inside an I/O callback, as a busy gateway's own
    reads and writes do (the lag is what is simulated: this sleep is the point)."""
    inside, outside = socket.socketpair()
    inside.setblocking(False)

    def held() -> None:
        inside.recv(1)
        time.sleep(seconds)

    async def watch() -> None:
        asyncio.get_running_loop().add_reader(inside, held)

    async def unwatch() -> None:
        asyncio.get_running_loop().remove_reader(inside)

    gw.call(watch)
    try:
        yield lambda: outside.send(b"x") and None
    finally:
        gw.call(unwatch)
        inside.close()
        outside.close()


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
async def test_a_request_sent_within_the_keep_alive_is_answered_when_the_gateway_runs_late(
    make_sim: Callable[..., SimServer], make_gateway: Callable[..., GatewayServer],
    loop_factory: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    gw = make_gateway(make_sim(), keep_alive_timeout=IDLE, loop_factory=loop_factory)
    conn = Connection(*await asyncio.open_connection(*host_port(gw.url)))
    try:
        with holding(gw, 1.6) as hold:
            assert (await conn.post(completion(16, 8))).status == 200
            await asyncio.sleep(IDLE - 1.0)
            hold()  # the gateway's loop is busy from here until 0.6 s past the idle deadline
            await asyncio.sleep(0.2)
            answer = await conn.post(completion(16, 8))  # sent 0.8 s before the idle deadline
        assert answer.status == 200, answer.body[:300]
    finally:
        await close_writer(conn.writer)


HEADER_TIMEOUT = 1.5  # --header-timeout for the late-read cases below
BODY_GRACE, BODY_RATE = 0.5, 1000.0  # a body's deadline: 0.5 s, then 1 s more for each 1,000 bytes that came


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
@pytest.mark.parametrize(
    ("phase", "first", "hold_at"),
    [
        # The request line's first bytes, then the rest of the head 1.1 s later (0.4 s before the header
        # deadline), while the loop is held up from 0.9 s to 2.1 s (0.6 s past the deadline).
        ("head", 20, 0.9),
        # The head and 1,000 bytes of the body (deadline 1.5 s), then the rest of the body 0.9 s later, while the
        # loop is held up from 0.7 s to 2.1 s.
        ("body", 1000, 0.7),
    ],
)
async def test_a_deadline_that_passes_while_the_clients_bytes_wait_unread_is_judged_after_reading_them(
    make_sim: Callable[..., SimServer], make_gateway: Callable[..., GatewayServer],
    loop_factory: Callable[[], asyncio.AbstractEventLoop], phase: str, first: int, hold_at: float,
) -> None:
    """A busy gateway's loop runs its due timers before it reads (uvloop): the header timeout fired over a head
    that had come in time, and the client got a 408 (seen once under an overload beside a CPU hog)."""
    gw = make_gateway(
        make_sim(), header_timeout=HEADER_TIMEOUT, min_body_rate=BODY_RATE, body_rate_grace=BODY_GRACE,
        loop_factory=loop_factory,
    )
    body = json.dumps(completion(16, 8)).encode() + b" " * 3000  # JSON's own whitespace: 3 s of body time
    data = request_bytes("POST", "/v1/completions", {"content-type": "application/json"}, body)
    if phase == "body":
        first += data.index(b"\r\n\r\n") + 4
    reader, writer = await asyncio.open_connection(*host_port(gw.url))
    try:
        with holding(gw, 2.1 - hold_at) as hold:
            writer.write(data[:first])
            await writer.drain()
            await asyncio.sleep(hold_at)
            hold()
            await asyncio.sleep(0.2)
            writer.write(data[first:])  # before the deadline, while the gateway's loop is held up
            await writer.drain()
            answer = await asyncio.wait_for(read_response(reader), 10)
        assert answer is not None and answer.status == 200, answer
    finally:
        await close_writer(writer)
