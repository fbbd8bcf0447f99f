"""A scripted, misbehaving upstream on loopback, and a raw HTTP client that sees each write of the gateway.

``BadUpstream`` is a raw asyncio HTTP/1.1 server in a thread. It answers the gateway's scrapes (/v1/models,
/metrics, /health) like a healthy vLLM and every other request with ``answer``, set by the test: exact bytes,
written in the pieces the test chose, with a pause between pieces so that the gateway reads them apart.
Every other request is recorded with its headers and body.

``raw_request`` reads the gateway's chunked response chunk by chunk: uvicorn writes one HTTP chunk per ASGI
send, so each chunk is exactly one write of the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import socket
import struct
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit

import orjson

MODEL = "tiny"
MAX_MODEL_LEN = 512
_METRICS = (
    b"# TYPE vllm:cache_config_info gauge\n"
    b'vllm:cache_config_info{block_size="16",num_gpu_blocks="256",engine="0"} 1.0\n'
    b'vllm:kv_cache_usage_perc{model_name="tiny",engine="0"} 0.0\n'
    b'vllm:num_requests_running{model_name="tiny",engine="0"} 0.0\n'
    b'vllm:num_requests_waiting{model_name="tiny",engine="0"} 0.0\n'
)
_MODELS = orjson.dumps({"object": "list", "data": [
    {"id": MODEL, "object": "model", "owned_by": "vllm", "root": MODEL, "max_model_len": MAX_MODEL_LEN},
]})
SCRAPES = ("/v1/models", "/metrics", "/health", "/version")
_SCRAPE_ANSWERS = {"/metrics": (_METRICS, "text/plain"), "/v1/models": (_MODELS, "application/json")}

Answer = Callable[[asyncio.StreamWriter], Awaitable[None]]


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


def head(status: int, headers: list[tuple[str, str]]) -> bytes:
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def full(status: int, body: bytes, ctype: str = "application/json", headers: tuple[tuple[str, str], ...] = ()
         ) -> Answer:
    """A whole answer with its Content-Length."""

    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(head(status, [("content-type", ctype), ("content-length", str(len(body))), *headers,
                                   ("connection", "close")]) + body)

    return answer


def chunked(pieces: list[bytes], *, status: int = 200, ctype: str = "text/event-stream",
            headers: tuple[tuple[str, str], ...] = (), end: str = "clean", pause: float = 0.002) -> Answer:
    """A chunked answer, one HTTP chunk per piece, each sent on its own. ``end``: "clean" (the last chunk),
    "cut" (the connection closed without it) or "reset" (TCP RST)."""

    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(head(status, [("content-type", ctype), ("transfer-encoding", "chunked"), *headers,
                                   ("connection", "close")]))
        for piece in pieces:
            writer.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            await writer.drain()
            await asyncio.sleep(pause)
        if end == "clean":
            writer.write(b"0\r\n\r\n")
        elif end == "reset":
            reset(writer)

    return answer


def reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def gzipped(data: bytes) -> bytes:
    return gzip.compress(data)


@dataclass
class BadUpstream:
    url: str = ""
    answer: Answer = field(default_factory=lambda: full(200, b"{}"))
    seen: list[Seen] = field(default_factory=list)

    def requests(self) -> list[Seen]:
        """What reached the "engine": everything but the gateway's scrapes."""
        return [s for s in list(self.seen) if s.path not in SCRAPES]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:  # each piece leaves at once, not coalesced by Nagle
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while (req := await _read_request(reader)) is not None:
                if req.path in SCRAPES:
                    body, ctype = _SCRAPE_ANSWERS.get(req.path, (b"{}", "application/json"))
                    writer.write(head(200, [("content-type", ctype), ("content-length", str(len(body)))]) + body)
                    await writer.drain()
                    continue
                self.seen.append(req)
                await self.answer(writer)
                break  # one answer per connection: the scripted ones need not be readable to their end
            with contextlib.suppress(ConnectionError):
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()


async def _read_request(reader: asyncio.StreamReader) -> Seen | None:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = raw.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return Seen(method, target.split("?", 1)[0], headers, body)


@contextlib.contextmanager
def run_bad_upstream() -> Iterator[BadUpstream]:
    upstream = BadUpstream()
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stop: list[asyncio.Event] = []

    async def main() -> None:
        server = await asyncio.start_server(upstream._serve, "127.0.0.1", 0)
        upstream.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        stop.append(asyncio.Event())
        ready.set()
        async with server:
            await stop[0].wait()

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), name="bad-upstream", daemon=True)
    thread.start()
    ready.wait(10)
    try:
        yield upstream
    finally:
        loop.call_soon_threadsafe(stop[0].set)
        thread.join(10)
        loop.close()


# -- the client side ------------------------------------------------------------------------------
@dataclass
class RawReply:
    status: int
    headers: dict[str, str]
    chunks: list[bytes]  # one per write of the gateway when the body was chunked

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def json(self) -> Any:
        return orjson.loads(self.body)


def raw_request(url: str, path: str, body: bytes = b"", method: str = "POST",
                headers: dict[str, str] | None = None, timeout: float = 15.0) -> RawReply:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    lines = [f"{method} {path} HTTP/1.1", f"host: {host}:{port}", "connection: close",
             "content-type: application/json", f"content-length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        data = bytearray()
        while chunk := sock.recv(65536):
            data += chunk
    raw_head, _, rest = bytes(data).partition(b"\r\n\r\n")
    status_line, *header_lines = raw_head.decode("latin-1").split("\r\n")
    reply_headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        reply_headers[name.strip().lower()] = value.strip()
    if reply_headers.get("transfer-encoding") != "chunked":
        return RawReply(int(status_line.split()[1]), reply_headers, [rest] if rest else [])
    chunks = []
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        chunks.append(rest[:size])
        rest = rest[size + 2:]
    return RawReply(int(status_line.split()[1]), reply_headers, chunks)


def is_one_whole_event(write: bytes) -> bool:
    """One SSE event: it ends with its blank line and holds no other before."""
    for end in (b"\r\n\r\n", b"\n\n", b"\r\r"):
        if write.endswith(end):
            body = write[: -len(end)]
            return body != b"" and all(sep not in body for sep in (b"\n\n", b"\r\r", b"\r\n\r\n", b"\n\r\n"))
    return False
