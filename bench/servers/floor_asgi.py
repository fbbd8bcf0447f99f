"""The floor of a Python proxy served through ASGI: ``bench.servers.floor``'s proxy behind uvicorn's request-response
cycle, to price that cycle alone.

The gateway's server is uvicorn (httptools, uvloop) with a protocol of its own; each guarded request runs in
uvicorn's ASGI task, reads its body through ``receive`` and answers a whole body through ``send`` (a stream's
events bypass ``send``: ``gateway/http/stream_out.py``). Whether a request path in the server's protocol callbacks,
without that cycle, would bring the gateway near its peers is a question of what the cycle costs. This proxy is the
floor's (one pooled keep-alive connection to the engine per request at a time, the request written in one write,
no counting, logging or timeouts) with only the ASGI cycle added: the body read through ``receive``, the engine's
answer parsed into ASGI's messages (its status and headers, then the body of each upstream read as one message) and
handed to ``send``, which writes them as uvicorn does. ``floor-asgi`` against ``floor`` is that cycle's price.

    python -m bench.servers.floor_asgi --port 8100 http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import socket
from typing import Any, cast
from urllib.parse import urlsplit

import httptools
import uvicorn

Message = dict[str, Any]
# Headers of the engine's answer that describe its own framing: uvicorn frames the answer itself (a length when
# the start gives one, else chunks).
_FRAMING = {b"transfer-encoding", b"connection", b"keep-alive"}


class Upstream(asyncio.Protocol):
    """One keep-alive connection to the engine; its answer goes to ``answer`` as ASGI messages."""

    def __init__(self, pool: list[Upstream]) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer: asyncio.Queue[Message] | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio's classes

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)
        if self._body and self.answer is not None:  # one body message a read, as the floor writes once a read
            self.answer.put_nowait({"type": "http.response.body", "body": b"".join(self._body), "more_body": True})
            self._body = []

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() not in _FRAMING:
            self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        headers, self._headers = self._headers, []
        if self.answer is not None:
            self.answer.put_nowait(
                {"type": "http.response.start", "status": self.parser.get_status_code(), "headers": headers}
            )

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        answer, self.answer = self.answer, None
        if answer is not None:
            if self._body:
                answer.put_nowait({"type": "http.response.body", "body": b"".join(self._body), "more_body": True})
                self._body = []
            answer.put_nowait({"type": "http.response.body", "body": b"", "more_body": False})
        self.pool.append(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.pool:
            self.pool.remove(self)
        answer, self.answer = self.answer, None
        if answer is not None:
            answer.put_nowait({"type": "lost"})


class AsgiProxy:
    """The ASGI app: each request's body read whole, written to the engine, its answer sent as it arrives."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.address = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.host = parts.netloc.encode()
        self.idle: list[Upstream] = []

    async def __call__(self, scope: Message, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        chunks: list[bytes] = []
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        path = scope["raw_path"] or scope["path"].encode()
        head = b"%s %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % (
            scope["method"].encode(), path, self.host, len(body))
        answer: asyncio.Queue[Message] = asyncio.Queue()
        upstream = self.idle.pop() if self.idle else await self._connect()
        if upstream is None:
            await send({"type": "http.response.start", "status": 502, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        upstream.answer = answer
        assert upstream.transport is not None
        upstream.transport.write(head + body)
        while True:
            message = await answer.get()
            if message["type"] == "lost":
                raise ConnectionError("the engine closed the connection mid-answer")
            await send(message)
            if message["type"] == "http.response.body" and not message["more_body"]:
                return

    async def _connect(self) -> Upstream | None:
        try:
            _, upstream = await asyncio.get_running_loop().create_connection(lambda: Upstream(self.idle), *self.address)
        except OSError:
            return None
        return upstream

    def close(self) -> None:
        """Close the idle connections to the engine."""
        for upstream in self.idle:
            if upstream.transport is not None:
                upstream.transport.close()
        self.idle.clear()


def server(app: AsgiProxy) -> uvicorn.Server:
    """uvicorn as the gateway runs it (httptools, uvloop), with nothing of its own logged."""
    config = uvicorn.Config(app, loop="uvloop", http="httptools", lifespan="off", access_log=False,
                            log_level="warning", backlog=4096)
    return uvicorn.Server(config)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("upstream")
    args = parser.parse_args(argv)
    sock = socket.create_server(("127.0.0.1", args.port), backlog=4096)
    server(AsgiProxy(args.upstream)).run(sockets=[sock])


if __name__ == "__main__":
    main()
