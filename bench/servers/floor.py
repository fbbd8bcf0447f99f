"""The floor of a Python proxy: the least a proxy on this stack (uvloop, an asyncio protocol, httptools) can do
per request and per relayed event, measured beside the gateway and vllm-router.

It parses the client's request (httptools), writes it to the upstream over a pooled keep-alive connection in one
write, and hands the upstream's answer back byte for byte as it arrives (status line, headers, chunked events:
one client write per upstream read), parsing the answer only to know where it ends. No routing, no headers of
its own, no counting, no logging, no timeouts: nothing a guard needs, only what any Python proxy must do. What
the gateway spends above this is its own work; what this spends above vllm-router is the interpreter's and the
event loop's price for the same bytes, which no Python data plane gets under.

    python -m bench.servers.floor --port 8100 http://127.0.0.1:8000 [--count TOKENIZER_DIR]

``--count``: the one piece of a guard's work added (target ``floor-count``): each chat's body is parsed (orjson) and
its prompt's token ids computed by the gateway's own counter (``LocalCounter``: the model's chat template rendered
as vLLM renders it, the text tokenized with the piece cache), inline, before it is forwarded as it came.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from typing import cast
from urllib.parse import urlsplit

import httptools
import orjson
import uvloop

Count = Callable[[bytes], object]


class Upstream(asyncio.Protocol):
    """One keep-alive connection to the engine; relays one answer at a time to ``client``."""

    def __init__(self, pool: list[Upstream]) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.client: Client | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio's classes

    def data_received(self, data: bytes) -> None:
        client = self.client
        if client is not None and client.transport is not None and not client.transport.is_closing():
            client.transport.write(data)  # the answer as the engine wrote it
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        client, self.client = self.client, None
        self.pool.append(self)
        if client is not None:
            client.answered()

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.pool:
            self.pool.remove(self)
        client, self.client = self.client, None
        if client is not None and client.transport is not None:
            client.transport.close()


class Client(asyncio.Protocol):
    """One client connection: a request at a time, forwarded whole."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.keep_alive = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio's classes

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        method = self.parser.get_method()
        body = b"".join(self.body)
        self.body = []
        head = b"%s %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % (
            method, self.url, self.proxy.host, len(body))
        self.proxy.forward(self, head + body, body)

    def answered(self) -> None:
        if not self.keep_alive and self.transport is not None:
            self.transport.close()


class Proxy:
    def __init__(self, upstream: str, count: Count | None = None) -> None:
        self.count = count
        parts = urlsplit(upstream)
        self.address = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.host = parts.netloc.encode()
        self.idle: list[Upstream] = []

    def forward(self, client: Client, request: bytes, body: bytes = b"") -> None:
        if self.count is not None and body:
            self.count(body)
        if self.idle:
            self._send(self.idle.pop(), client, request)
        else:
            asyncio.get_running_loop().create_task(self._connect_and_send(client, request))

    async def _connect_and_send(self, client: Client, request: bytes) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, upstream = await loop.create_connection(lambda: Upstream(self.idle), *self.address)
        except OSError:
            if client.transport is not None:
                client.transport.write(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n")
            return
        self._send(upstream, client, request)

    def close(self) -> None:
        """Close the idle connections to the engine."""
        for upstream in self.idle:
            if upstream.transport is not None:
                upstream.transport.close()
        self.idle.clear()

    @staticmethod
    def _send(upstream: Upstream, client: Client, request: bytes) -> None:
        upstream.client = client
        assert upstream.transport is not None
        upstream.transport.write(request)


def counter(tokenizer_dir: str) -> Count:
    """The gateway's own count of a chat's prompt (its ids), from its body's bytes."""
    from transformers import AutoTokenizer

    from gateway.guard.counting.local import LocalCounter

    local = LocalCounter(AutoTokenizer.from_pretrained(tokenizer_dir))

    def count(body: bytes) -> object:
        parsed = orjson.loads(body)
        return local.tokenize_chat_sync(parsed) if isinstance(parsed, dict) and "messages" in parsed else None

    return count


async def serve(port: int, upstream: str, count: Count | None = None) -> None:
    proxy = Proxy(upstream, count)
    server = await asyncio.get_running_loop().create_server(lambda: Client(proxy), "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--count", metavar="TOKENIZER_DIR", default=None,
                        help="also parse each chat and count its prompt with the gateway's counter")
    parser.add_argument("upstream")
    args = parser.parse_args(argv)
    uvloop.run(serve(args.port, args.upstream, counter(args.count) if args.count else None))


if __name__ == "__main__":
    main()
