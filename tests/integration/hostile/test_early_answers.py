"""Answers that come while the client is still sending its body: the client finishes writing and reads the
answer, never a reset mid-write, and a connection the gateway keeps serves the next request.

A 401, 404 or 405 is answered before the body is read. The connection stays open and the rest of the body is
read and discarded; the idle timeout (``--keep-alive-timeout``) used to start at the answer, and cut a client
still sending with a reset (an aiohttp client's ``Can not write request body``). A 413 ends the connection, but a
client that writes its whole body before reading (httpx, the OpenAI SDK) was reset after a second and never saw
the 413. What is discarded stays bounded: the body's own limits hold it, and a refused upload keeps the
connection only while it arrives as a body must.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gateway.http.server import LINGER
from testing.gateway_thread import run_gateway
from testing.hostile_checks import (
    Case,
    Target,
    check_answer,
    close_writer,
    closed_within,
    host_port,
    read_response,
    statuses,
)
from testing.vllm_sim import SimServer

from .conftest import BODY_LIMIT, CLIENT_KEY, NORMAL_CHAT, UPSTREAM_KEY, hostile_settings

CHAT = "/v1/chat/completions"
IDLE = 0.3  # --keep-alive-timeout: each upload below takes several times this
BODY_GRACE = 0.5
MIN_BODY_RATE = 4000.0  # bytes a second: the uploads below send more, the trickles less
SLACK = 1.0
AUTH = f"authorization: Bearer {CLIENT_KEY}\r\n"


@pytest.fixture(scope="module")
def early_gw(sim: SimServer, tokenizer_dir: Path) -> Iterator[Target]:
    settings = hostile_settings(
        tokenizer_dir, upstream=sim.url, upstream_api_key=UPSTREAM_KEY, api_key=[CLIENT_KEY],
        keep_alive_timeout=IDLE, body_timeout=5.0, min_body_rate=MIN_BODY_RATE, body_rate_grace=BODY_GRACE,
    )
    with run_gateway(settings) as server:
        target = Target(server, CLIENT_KEY, json.dumps(NORMAL_CHAT).encode())
        yield target
        target.close()


def head(method: str, path: str, extra: str) -> bytes:
    return f"{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n{extra}\r\n".encode()


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def upload(writer: asyncio.StreamWriter, pieces: list[bytes], every: float) -> BaseException | None:
    """Write each piece ``every`` seconds apart without reading; the error a write met, if any."""
    try:
        for piece in pieces:
            await asyncio.sleep(every)
            writer.write(piece)
            await writer.drain()
    except (ConnectionError, OSError) as exc:
        return exc
    return None


@dataclass(frozen=True)
class Early:
    id: str
    head: bytes
    status: int


BODY = b"[" + b" " * 5998 + b"]"
EARLY = [
    Early("no API key (401)", head("POST", CHAT, f"content-length: {len(BODY)}\r\n"), 401),
    Early("unknown path (404)", head("POST", "/v1/nothing", f"{AUTH}content-length: {len(BODY)}\r\n"), 404),
    Early("wrong method (405)", head("PUT", CHAT, f"{AUTH}content-length: {len(BODY)}\r\n"), 405),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in EARLY])
async def test_a_request_answered_before_its_body_keeps_its_connection(early_gw: Target, case: Early) -> None:
    reader, writer = await asyncio.open_connection(*host_port(early_gw.url))
    try:
        writer.write(case.head)
        # 1.2 s of body: four idle timeouts, well within the body's own limits.
        pieces = [BODY[i:i + 500] for i in range(0, len(BODY), 500)]
        error = await upload(writer, pieces, 0.1)
        assert error is None, f"{case.id}: the gateway reset the connection while the body was sent: {error!r}"
        answer = await asyncio.wait_for(read_response(reader), 5)
        assert answer is not None, f"{case.id}: no answer"
        check_answer(answer.status, answer.body, Case(case.id, status=statuses(case.status)))
        assert answer.headers.get("connection") != "close", answer.headers
        writer.write(head("POST", CHAT, f"{AUTH}content-length: {len(early_gw.normal_body)}\r\n")
                     + early_gw.normal_body)
        following = await asyncio.wait_for(read_response(reader), 5)
        assert following is not None and following.status == 200, "the kept connection did not serve the next"
    finally:
        await close_writer(writer)
    early_gw.still_well()


OVER = 4 * BODY_LIMIT  # an upload the gateway refuses, sent in 16 pieces over 1.6 s: longer than LINGER
UPLOADS = {
    "declared too large (413 before the body)": (
        head("POST", CHAT, f"{AUTH}content-length: {OVER}\r\n"), [b"x" * (OVER // 16)] * 16,
    ),
    "chunked past the limit (413 while the body arrives)": (
        head("POST", CHAT, f"{AUTH}transfer-encoding: chunked\r\n"), [chunk(b"x" * (OVER // 16))] * 16 + [b"0\r\n\r\n"],
    ),
}


@pytest.mark.parametrize("name", list(UPLOADS))
async def test_a_client_still_uploading_when_refused_reads_its_413(early_gw: Target, name: str) -> None:
    first, pieces = UPLOADS[name]
    reader, writer = await asyncio.open_connection(*host_port(early_gw.url))
    try:
        writer.write(first)
        error = await upload(writer, pieces, 0.1)
        assert error is None, f"{name}: reset while the client was still sending: {error!r}"
        answer = await asyncio.wait_for(read_response(reader), 5)
        assert answer is not None, f"{name}: no answer"
        check_answer(answer.status, answer.body, Case(name, status=statuses(413)))
        assert answer.headers.get("connection") == "close", answer.headers
        closed, _ = await closed_within(reader, LINGER + SLACK)
        assert closed, f"{name}: the refused connection stayed open"
    finally:
        await close_writer(writer)
    early_gw.still_well()


async def trickle(writer: asyncio.StreamWriter, unit: bytes, every: float) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while True:
            await asyncio.sleep(every)
            writer.write(unit)
            await writer.drain()


@dataclass(frozen=True)
class Bounded:
    id: str
    first: bytes
    unit: bytes  # then sent again and again (b"": silence)
    every: float
    status: int


BOUNDED = [
    Bounded("half a body answered early, then silence", head("POST", CHAT, "content-length: 6000\r\n") + b"[" * 100,
            b"", 0.1, 401),
    Bounded("a chunked body answered early that never ends", head("POST", CHAT, "transfer-encoding: chunked\r\n"),
            chunk(b"x" * 8192), 0.0, 401),
    Bounded("an upload refused with 413 and trickled on", head("POST", CHAT, f"{AUTH}content-length: {OVER}\r\n"),
            b"x", 0.3, 413),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in BOUNDED])
async def test_what_is_discarded_after_an_answer_stays_bounded(early_gw: Target, case: Bounded) -> None:
    reader, writer = await asyncio.open_connection(*host_port(early_gw.url))
    writer.write(case.first)
    sender = asyncio.create_task(trickle(writer, case.unit, case.every)) if case.unit else None
    try:
        # The body's deadline for what came (its grace, at most), then LINGER: the answer was sent already.
        closed, data = await closed_within(reader, BODY_GRACE + LINGER + 2 * SLACK)
    finally:
        if sender is not None:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sender
        await close_writer(writer)
    assert closed, f"{case.id}: the connection was still open"
    assert data.startswith(f"HTTP/1.1 {case.status} ".encode()), data[:200]
    early_gw.still_well()
