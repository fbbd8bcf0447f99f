"""The floor proxy hands back the engine's answers byte for byte (whole answers, streams, one request after
another on a keep-alive connection, several at once), so that what it costs is a proxy's price for the same
bytes the gateway and vllm-router move; served through uvicorn's ASGI cycle (``floor_asgi``), the same answers
with the same bodies."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bench.servers.fake_engine import Connection, Engine
from bench.servers.floor import Client, Proxy, counter
from bench.servers.floor_asgi import AsgiProxy, server
from gateway.guard.counting.counter import PromptTokens
from tests.bench.test_fake_engine import anonymous, exchange

CHAT = b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":4}'
STREAM = b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":5,"stream":true}'


@pytest.fixture
def counted() -> list[bytes]:
    return []


@pytest.fixture(params=["floor", "floor-asgi"])
async def ports(request: pytest.FixtureRequest, counted: list[bytes]) -> AsyncIterator[tuple[int, int]]:
    """The fake engine's port and a floor's in front of it: the protocol's (the bodies it counted in ``counted``),
    or the one served through uvicorn's ASGI cycle."""
    loop = asyncio.get_running_loop()
    engine = await loop.create_server(lambda: Connection(Engine("tiny", 4096, 0.0)), "127.0.0.1", 0)
    engine_port = engine.sockets[0].getsockname()[1]
    upstream = f"http://127.0.0.1:{engine_port}"
    try:
        if request.param == "floor":
            async with floor_protocol(upstream, counted) as port:
                yield engine_port, port
        else:
            async with floor_asgi(upstream) as port:
                yield engine_port, port
    finally:
        engine.close()
        await asyncio.sleep(0)  # the closed transports' callbacks


@contextlib.asynccontextmanager
async def floor_protocol(upstream: str, counted: list[bytes]) -> AsyncIterator[int]:
    proxy = Proxy(upstream, counted.append)
    floor = await asyncio.get_running_loop().create_server(lambda: Client(proxy), "127.0.0.1", 0)
    try:
        yield floor.sockets[0].getsockname()[1]
    finally:
        floor.close()
        proxy.close()


@contextlib.asynccontextmanager
async def floor_asgi(upstream: str) -> AsyncIterator[int]:
    app = AsgiProxy(upstream)
    sock = socket.create_server(("127.0.0.1", 0))
    uvicorn_server = server(app)
    serving = asyncio.create_task(uvicorn_server.serve(sockets=[sock]))
    try:  # the socket listens already: a client's connection waits in its backlog until uvicorn accepts it
        yield sock.getsockname()[1]
    finally:
        uvicorn_server.should_exit = True
        await asyncio.wait_for(serving, 10)
        app.close()
        sock.close()


@pytest.mark.parametrize("body", [CHAT, STREAM], ids=["whole answer", "stream"])
async def test_an_answer_comes_back_as_the_engine_wrote_it(ports: tuple[int, int], body: bytes) -> None:
    engine, floor = ports
    direct = await exchange(engine, "POST", "/v1/chat/completions", body)
    through = await exchange(floor, "POST", "/v1/chat/completions", body)
    assert through[0].split(b"\r\n")[0] == b"HTTP/1.1 200 OK"
    # The same bytes; the ASGI floor sends an upstream read's events as one chunk, so only the whole is compared.
    assert anonymous(b"".join(through[1])) == anonymous(b"".join(direct[1]))


async def test_one_connection_carries_one_request_after_another(ports: tuple[int, int]) -> None:
    _, floor = ports
    reader, writer = await asyncio.open_connection("127.0.0.1", floor)
    try:
        for _ in range(3):
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(CHAT), CHAT))
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            assert b'"chat.completion"' in await asyncio.wait_for(reader.readexactly(length), 10)
    finally:
        writer.close()


async def test_requests_at_once_each_get_their_own_answer(ports: tuple[int, int]) -> None:
    _, floor = ports
    answers = await asyncio.gather(*(exchange(floor, "POST", "/v1/chat/completions", STREAM) for _ in range(8)))
    assert all(b"".join(a[1]).endswith(b"data: [DONE]\n\n") for a in answers)
    assert len({anonymous(b"".join(a[1])) for a in answers}) == 1


@pytest.mark.parametrize("ports", ["floor"], indirect=True)
async def test_with_a_count_each_chat_is_counted_once_before_it_is_forwarded(ports: tuple[int, int],
                                                                            counted: list[bytes]) -> None:
    _, floor = ports
    await exchange(floor, "POST", "/v1/chat/completions", CHAT)
    await exchange(floor, "POST", "/v1/chat/completions", STREAM)
    assert counted == [CHAT, STREAM]


def test_the_count_is_the_gateways_own_of_the_chats_prompt(tokenizer_dir: Path) -> None:
    count = counter(str(tokenizer_dir))
    tokens = count(CHAT)
    assert isinstance(tokens, PromptTokens) and tokens.ids is not None and tokens.count == len(tokens.ids) > 0
