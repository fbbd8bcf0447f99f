"""The floor proxy hands back the engine's answers byte for byte (whole answers, streams, one request after
another on a keep-alive connection, several at once), so that what it costs is a proxy's price for the same
bytes the gateway and vllm-router move."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bench.servers.fake_engine import Connection, Engine
from bench.servers.floor import Client, Proxy, counter
from gateway.guard.counting.counter import PromptTokens
from tests.bench.test_fake_engine import anonymous, exchange

CHAT = b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":4}'
STREAM = b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":5,"stream":true}'


@pytest.fixture
def counted() -> list[bytes]:
    return []


@pytest.fixture
async def ports(counted: list[bytes]) -> AsyncIterator[tuple[int, int]]:
    """The fake engine's port and the floor's in front of it (the bodies it counted in ``counted``)."""
    loop = asyncio.get_running_loop()
    engine = await loop.create_server(lambda: Connection(Engine("tiny", 4096, 0.0)), "127.0.0.1", 0)
    engine_port = engine.sockets[0].getsockname()[1]
    proxy = Proxy(f"http://127.0.0.1:{engine_port}", counted.append)
    floor = await loop.create_server(lambda: Client(proxy), "127.0.0.1", 0)
    try:
        yield engine_port, floor.sockets[0].getsockname()[1]
    finally:
        floor.close()
        proxy.close()
        engine.close()
        await asyncio.sleep(0)  # the closed transports' callbacks


@pytest.mark.parametrize("body", [CHAT, STREAM], ids=["whole answer", "stream"])
async def test_an_answer_comes_back_as_the_engine_wrote_it(ports: tuple[int, int], body: bytes) -> None:
    engine, floor = ports
    direct = await exchange(engine, "POST", "/v1/chat/completions", body)
    through = await exchange(floor, "POST", "/v1/chat/completions", body)
    assert through[0].split(b"\r\n")[0] == b"HTTP/1.1 200 OK"
    assert [anonymous(c) for c in through[1]] == [anonymous(c) for c in direct[1]]


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
    assert all(a[1][-1] == b"data: [DONE]\n\n" for a in answers)


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
