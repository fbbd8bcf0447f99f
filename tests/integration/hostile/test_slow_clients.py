"""Slow and idle clients: every phase of a connection is bounded in time (idle, headers, body) and the number
of connections is capped, each refusal in OpenAI's shape where there is one. The limits are passed small, so
that each case ends within about a second."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from testing.gateway_thread import run_gateway
from testing.hostile_checks import (
    Case,
    Target,
    check_answer,
    close_writer,
    closed_within,
    host_port,
    parse_raw,
    raw_exchange,
    read_response,
    request_bytes,
    statuses,
)
from testing.vllm_sim import SimServer

from .conftest import BODY_LIMIT, NORMAL_CHAT, UPSTREAM_KEY, hostile_settings

CHAT = "/v1/chat/completions"
BODY = json.dumps(NORMAL_CHAT).encode()
HEADER_TIMEOUT = 0.5
IDLE_TIMEOUT = 0.5
BODY_TIMEOUT = 1.0
BODY_GRACE = 0.3
MIN_BODY_RATE = 200.0
# How much later than its limit a refusal may come (a loaded machine, the timer's own granularity).
SLACK = 1.0
SLOW_SETTINGS = ("header_timeout", "keep_alive_timeout", "body_timeout", "min_body_rate", "body_rate_grace",
                 "max_connections")


def _limits_exist() -> bool:
    from gateway.config import Settings

    return all(name in Settings.model_fields for name in SLOW_SETTINGS)


pytestmark = pytest.mark.skipif(
    not _limits_exist(), reason=f"gateway.config.Settings lacks some of {', '.join(SLOW_SETTINGS)}"
)


@pytest.fixture(scope="module")
def slow_gw(sim: SimServer, tokenizer_dir: Path) -> Iterator[Target]:
    settings = hostile_settings(
        tokenizer_dir, upstream=sim.url, upstream_api_key=UPSTREAM_KEY, header_timeout=HEADER_TIMEOUT,
        keep_alive_timeout=IDLE_TIMEOUT, body_timeout=BODY_TIMEOUT, min_body_rate=MIN_BODY_RATE,
        body_rate_grace=BODY_GRACE,
    )
    with run_gateway(settings) as server:
        target = Target(server, None, BODY)
        yield target
        target.close()


Writer = asyncio.StreamWriter
Script = Callable[[Writer], Awaitable[None]]


def stall_after(data: bytes) -> Script:
    async def run(w: Writer) -> None:
        if data:
            w.write(data)
            await w.drain()
        await asyncio.sleep(3600)

    return run


def trickle(prefix: bytes, unit: bytes, every: float) -> Script:
    async def run(w: Writer) -> None:
        w.write(prefix)
        await w.drain()
        while True:
            await asyncio.sleep(every)
            w.write(unit)
            await w.drain()

    return run


def flood_chunks(prefix: bytes, size: int) -> Script:
    async def run(w: Writer) -> None:
        w.write(prefix)
        chunk = f"{size:x}\r\n".encode() + b"a" * size + b"\r\n"
        while True:
            w.write(chunk)
            await w.drain()

    return run


HEAD = f"POST {CHAT} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n".encode()


@dataclass(frozen=True)
class Slow:
    id: str
    script: Script
    # None: the connection may end silently (an idle one) or with one of these statuses.
    status: frozenset[int] | None
    within: float


SLOW = [
    Slow("idle socket that never sends", stall_after(b""), None, IDLE_TIMEOUT + SLACK),
    Slow("half a request line", stall_after(b"POST /v1/chat/comp"), statuses(408), HEADER_TIMEOUT + SLACK),
    Slow("half the headers", stall_after(HEAD), statuses(408), HEADER_TIMEOUT + SLACK),
    Slow("headers trickled a byte at a time", trickle(f"POST {CHAT} HTTP/1.1\r\nx-".encode(), b"x", 0.05),
         statuses(408, 431), HEADER_TIMEOUT + SLACK),
    Slow("header line that never ends", trickle(HEAD + b"x-long: ", b"y" * 64, 0.02), statuses(408, 431),
         HEADER_TIMEOUT + SLACK),
    Slow("headers then no body", stall_after(HEAD + b"content-length: 100\r\n\r\n"), statuses(408),
         BODY_GRACE + SLACK),
    Slow("body trickled below the minimum rate", trickle(HEAD + b"content-length: 60000\r\n\r\n", b"{", 0.05),
         statuses(408), BODY_TIMEOUT + SLACK),
    Slow("half the body then silence", stall_after(HEAD + f"content-length: {len(BODY)}\r\n\r\n".encode()
                                                   + BODY[: len(BODY) // 2]), statuses(408), BODY_GRACE + SLACK),
    Slow("chunked body that never ends, slowly", trickle(HEAD + b"transfer-encoding: chunked\r\n\r\n", b"1\r\na\r\n",
                                                         0.05), statuses(408), BODY_TIMEOUT + SLACK),
    Slow("chunked body that never ends, fast", flood_chunks(HEAD + b"transfer-encoding: chunked\r\n\r\n", 8192),
         statuses(413), BODY_TIMEOUT + SLACK),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in SLOW])
async def test_a_slow_client_is_cut_off_in_time(slow_gw: Target, case: Slow) -> None:
    host, port = host_port(slow_gw.url)
    reader, writer = await asyncio.open_connection(host, port)
    sender = asyncio.create_task(_quietly(case.script(writer)))
    try:
        closed, data = await closed_within(reader, case.within)
    finally:
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sender
        await close_writer(writer)
    assert closed, f"{case.id}: the connection was still open after {case.within:g} s"
    answer = parse_raw(data)
    if answer is None:
        assert case.status is None, f"{case.id}: closed without the expected answer {sorted(case.status or ())}"
    else:
        status, body = answer
        check_answer(status, body, Case(case.id, status=case.status or statuses(408)))
    slow_gw.still_well()


async def _quietly(coro: Awaitable[None]) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        await coro


async def test_a_kept_alive_connection_is_closed_when_idle(slow_gw: Target) -> None:
    host, port = host_port(slow_gw.url)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request_bytes("POST", CHAT, {"content-type": "application/json"}, BODY))
        r = await asyncio.wait_for(read_response(reader), 5)
        assert r is not None and r.status == 200
        closed, data = await closed_within(reader, IDLE_TIMEOUT + SLACK)
        assert closed and data == b"", data
    finally:
        await close_writer(writer)
    slow_gw.still_well()


async def test_pipelined_requests_are_each_answered(slow_gw: Target) -> None:
    one = request_bytes("POST", CHAT, {"content-type": "application/json"}, BODY)
    host, port = host_port(slow_gw.url)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(one + one)
        for _ in range(2):
            r = await asyncio.wait_for(read_response(reader), 5)
            assert r is not None and r.status == 200
    finally:
        await close_writer(writer)
    slow_gw.still_well()


async def test_many_idle_sockets_are_all_closed(slow_gw: Target) -> None:
    host, port = host_port(slow_gw.url)
    pairs = [await asyncio.open_connection(host, port) for _ in range(50)]
    try:
        results = await asyncio.gather(*(closed_within(r, IDLE_TIMEOUT + SLACK) for r, _ in pairs))
    finally:
        for _, w in pairs:
            await close_writer(w)
    assert all(closed for closed, _ in results), sum(not c for c, _ in results)
    slow_gw.still_well()


async def test_connections_past_the_cap_get_503_in_openai_shape(sim: SimServer, tokenizer_dir: Path) -> None:
    settings = hostile_settings(
        tokenizer_dir, upstream=sim.url, upstream_api_key=UPSTREAM_KEY, max_connections=4, header_timeout=5.0,
        keep_alive_timeout=5.0,
    )
    # One process: with --workers each process holds its share of the cap (the kernel picks the process).
    with run_gateway(settings, workers="1") as server:
        target = Target(server, None, BODY)
        host, port = host_port(server.url)
        held = [await asyncio.open_connection(host, port) for _ in range(4)]
        try:
            await asyncio.sleep(0.1)  # the server accepts them on its own thread
            r = await raw_exchange(server.url, request_bytes("POST", CHAT, {"content-type": "application/json"}, BODY))
            assert r is not None
            check_answer(r.status, r.body, Case("past the cap", status=statuses(503)))
            assert r.headers.get("retry-after", "").isdigit()
        finally:
            for _, w in held:
                await close_writer(w)
        # Closed connections free their places; the server notices each close on its own loop.
        for _ in range(50):
            r = await raw_exchange(server.url, request_bytes("POST", CHAT, {"content-type": "application/json",
                                                                            "connection": "close"}, BODY))
            if r is not None and r.status == 200:
                break
            await asyncio.sleep(0.05)
        target.still_well()
        target.close()


async def test_a_body_over_the_limit_is_refused_before_it_is_read(slow_gw: Target) -> None:
    data = request_bytes("POST", CHAT, {"content-type": "application/json",
                                        "content-length": str(BODY_LIMIT + 1)}, b"")
    r = await raw_exchange(slow_gw.url, data, timeout=BODY_TIMEOUT + SLACK)
    assert r is not None
    check_answer(r.status, r.body, Case("declared too large", status=statuses(413)))
    slow_gw.still_well()
