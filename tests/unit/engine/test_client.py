"""The engine client: a pooled connection the engine closes as a request goes out costs no request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.config import Settings
from gateway.engine.client import Upstream
from gateway.errors import UpstreamUnavailable

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


class Engine:
    """Answers the first request on each connection; closes the connection on any later one, unanswered (as an
    engine whose idle timeout fires just as the gateway reuses the connection). ``answer_none``: closes every
    connection unanswered."""

    def __init__(self, *, answer_none: bool = False) -> None:
        self.answer_none = answer_none
        self.connections = 0
        self.answered = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        first = True
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                lines = head.lower().split(b"\r\n")
                length = next((int(ln.split(b":")[1]) for ln in lines if ln.startswith(b"content-length")), 0)
                await reader.readexactly(length)
                if not first or self.answer_none:
                    break
                first = False
                writer.write(OK)
                await writer.drain()
                self.answered += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


@pytest.fixture
async def engine_url() -> AsyncIterator[tuple[Engine, str]]:
    engine = Engine()
    server = await asyncio.start_server(engine.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield engine, f"http://127.0.0.1:{port}"


async def post(upstream: Upstream) -> int:
    stream = await upstream.open("POST", "/v1/completions", body=b'{"prompt": "x"}')
    try:
        return stream.status
    finally:
        stream.close()


async def test_a_request_on_a_pooled_connection_the_engine_closed_is_sent_again_on_a_new_one(
    engine_url: tuple[Engine, str],
) -> None:
    engine, url = engine_url
    upstream = Upstream(Settings(upstream=[url]))
    await upstream.start()
    try:
        assert [await post(upstream) for _ in range(3)] == [200, 200, 200]
    finally:
        await upstream.close()
    # Each later request went out on the pooled connection, which the engine closed; each was sent once more.
    assert engine.answered == 3 and engine.connections >= 3


async def test_an_engine_that_closes_every_connection_unanswered_is_unavailable(
    engine_url: tuple[Engine, str],
) -> None:
    engine, url = engine_url
    engine.answer_none = True
    upstream = Upstream(Settings(upstream=[url]))
    await upstream.start()
    try:
        with pytest.raises(UpstreamUnavailable, match="closed the connection before answering"):
            await post(upstream)
    finally:
        await upstream.close()
    assert engine.connections == 2  # sent once more, not again and again
