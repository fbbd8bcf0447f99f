"""A misbehaving vLLM on loopback: a raw asyncio HTTP/1.1 server that answers the gateway's scrapes properly
and misbehaves on every other request as the request asks.

The behaviour of a request is named inside its body as ``rogue:<mode>`` (a chat message, a prompt), so one
server and one gateway serve every case at once. Every request is recorded (method, raw target, headers,
body) so that a test can see exactly what reached the "engine", found by the ``x-request-id`` it sent.

    with run_rogue() as rogue:
        rogue.url, rogue.requests_with_id("case-1")
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import re
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

MODEL = "tiny"
MAX_MODEL_LEN = 512
NUM_BLOCKS = 256
BLOCK_SIZE = 16
# The read timeout of the gateway in front of the rogue: short, so that hung cases end quickly, yet long enough
# that a fault answered at once is never mistaken for silence on a loaded two-core machine (1 s was not).
SILENCE_S = 2.5

# Each names one way an upstream misbehaves on a generation (or pass-through) request.
MODES = (
    "ok", "reset", "close", "hang", "garbage", "not_http", "json_array", "json_scalar", "json_null", "empty_200",
    "gzip", "truncated", "bad_chunked", "bad_chunk_late", "huge_header", "broken_stream", "split_stream", "crlf_stream",
    "stream_no_done", "stream_json", "slow_stream", "error_503", "error_429", "error_405", "error_500_text",
    "error_400_flat", "endless_header", "endless_name", "endless_status", "surplus", "unasked", "long_stream",
)
# An endless head, by the part of it that never ends: what is written first, then written again and again.
ENDLESS = {
    "endless_header": (b"HTTP/1.1 200 OK\r\nx-endless: ", b"v"),
    "endless_name": (b"HTTP/1.1 200 OK\r\nx-", b"n"),
    "endless_status": (b"HTTP/1.1 200 ", b"r"),
}
ENDLESS_BYTES = 48 * 1024 * 1024  # written unless the client drops the connection before
_MODE = re.compile(rb"rogue:([a-z0-9_]+)")
_METRICS = (
    "# TYPE vllm:cache_config_info gauge\n"
    f'vllm:cache_config_info{{block_size="{BLOCK_SIZE}",num_gpu_blocks="{NUM_BLOCKS}",engine="0"}} 1.0\n'
    'vllm:kv_cache_usage_perc{model_name="tiny",engine="0"} 0.0\n'
    'vllm:num_requests_running{model_name="tiny",engine="0"} 0.0\n'
    'vllm:num_requests_waiting{model_name="tiny",engine="0"} 0.0\n'
    'vllm:num_preemptions_total{model_name="tiny",engine="0"} 0.0\n'
    'vllm:generation_tokens_total{model_name="tiny",engine="0"} 0.0\n'
).encode()


@dataclass
class Seen:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Request:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes
    mode: str = "ok"
    stream: bool = False


@dataclass
class Rogue:
    url: str = ""
    seen: list[Seen] = field(default_factory=list)
    written: dict[str, int] = field(default_factory=dict)  # bytes an endless head wrote, by request id
    accept_and_close: bool = False  # every new connection closed as soon as it is accepted
    _server: _Server | None = None
    _loop: asyncio.AbstractEventLoop | None = None

    @contextlib.contextmanager
    def closing_new_connections(self) -> Iterator[None]:
        """Every new connection accepted and closed at once; the kept-alive ones dropped first, so that the
        gateway has to open new ones."""
        assert self._loop is not None and self._server is not None
        self.accept_and_close = True
        asyncio.run_coroutine_threadsafe(self._server.drop_idle(), self._loop).result(5)
        try:
            yield
        finally:
            self.accept_and_close = False

    def requests_with_id(self, rid: str) -> list[Seen]:
        return [s for s in list(self.seen) if s.headers.get("x-request-id") == rid]

    def generation_requests(self) -> list[Seen]:
        """Everything but the gateway's own scrapes."""
        return [s for s in list(self.seen) if s.target not in ("/metrics", "/v1/models", "/health", "/version")]


# -- reading requests --------------------------------------------------------------------------------
async def _read_request(reader: asyncio.StreamReader) -> Request | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = await _read_chunked(reader)
    else:
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    found = _MODE.search(body)
    req = Request(method, target, headers, body, found.group(1).decode() if found else "ok")
    req.stream = bool(re.search(rb'"stream"\s*:\s*true', body))
    return req


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)


# -- answers -----------------------------------------------------------------------------------------
def _head(status: int, headers: list[tuple[str, str]]) -> bytes:
    from http import HTTPStatus

    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}"] + [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _full(status: int, body: bytes, ctype: str = "application/json", extra: list[tuple[str, str]] | None = None
          ) -> bytes:
    headers = [("content-type", ctype), ("content-length", str(len(body))), *(extra or [])]
    return _head(status, headers) + body


def completion_body(chat: bool) -> bytes:
    choice: dict[str, Any] = (
        {"index": 0, "message": {"role": "assistant", "content": "fine"}, "finish_reason": "stop"}
        if chat else {"index": 0, "text": "fine", "finish_reason": "stop"}
    )
    return json.dumps({
        "id": "rogue-1", "object": "chat.completion" if chat else "text_completion", "created": 1, "model": MODEL,
        "choices": [choice], "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }).encode()


def sse_events(chat: bool, count: int = 3) -> list[bytes]:
    events = []
    for i in range(count):
        delta = {"index": 0, "delta": {"content": f"t{i}"}} if chat else {"index": 0, "text": f"t{i}"}
        chunk = {"id": "rogue-s", "object": "chat.completion.chunk" if chat else "text_completion", "created": 1,
                 "model": MODEL, "choices": [delta]}
        events.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    return [*events, b"data: [DONE]\n\n"]


def _models() -> bytes:
    card = {"id": MODEL, "object": "model", "created": 1, "owned_by": "vllm", "root": MODEL, "parent": None,
            "max_model_len": MAX_MODEL_LEN, "permission": []}
    return json.dumps({"object": "list", "data": [card]}).encode()


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


SSE_HEAD = [("content-type", "text/event-stream; charset=utf-8"), ("transfer-encoding", "chunked")]


async def _stream(writer: asyncio.StreamWriter, req: Request, chat: bool) -> bool:
    """Answer a stream request by its mode; False when the connection must close afterwards."""
    mode = req.mode
    events = sse_events(chat, 20 if mode == "long_stream" else 3)
    if mode == "gzip":
        body = gzip.compress(b"".join(events))
        writer.write(_full(200, body, "text/event-stream", [("content-encoding", "gzip")]))
        return True
    writer.write(_head(200, SSE_HEAD))
    if mode == "broken_stream":
        writer.write(_chunk(events[0] + events[1] + events[2][:15]))
        await writer.drain()
        await asyncio.sleep(0.05)
        _reset(writer)
        return False
    if mode == "split_stream":
        for event in events:
            # Split right after "data:", the place that broke naive clients, with time in between.
            for piece in (event[:5], event[5:]):
                writer.write(_chunk(piece))
                await writer.drain()
                await asyncio.sleep(0.01)
        writer.write(b"0\r\n\r\n")
        return True
    if mode == "crlf_stream":
        events = [e.replace(b"\n", b"\r\n") for e in events]
    if mode == "stream_no_done":
        events = events[:-1]
    for i, event in enumerate(events):
        if mode == "slow_stream" and i == 1:
            await asyncio.sleep(SILENCE_S + 1.5)  # past the gateway's read timeout
        writer.write(_chunk(event))
        await writer.drain()
    writer.write(b"0\r\n\r\n")
    return True


async def _endless(writer: asyncio.StreamWriter, req: Request, rogue: Rogue) -> None:
    head, fill = ENDLESS[req.mode]
    piece = fill * 65536
    written = len(head)
    writer.write(head)
    try:
        while written < ENDLESS_BYTES and not writer.transport.is_closing():
            writer.write(piece)
            written += len(piece)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        rogue.written[req.headers.get("x-request-id", "")] = written


async def _answer(writer: asyncio.StreamWriter, req: Request, rogue: Rogue) -> bool:
    """Write the answer for one request; False when the connection must close afterwards."""
    if req.method == "GET" and req.target == "/metrics":
        writer.write(_full(200, _METRICS, "text/plain; version=0.0.4"))
        return True
    if req.method == "GET" and req.target == "/v1/models":
        writer.write(_full(200, _models()))
        return True
    if req.method == "GET" and req.target in ("/health", "/version"):
        writer.write(_full(200, b'{"version": "0.32.0"}'))
        return True
    chat = "chat" in req.target or "responses" in req.target
    mode = req.mode
    if mode in ("reset",):
        _reset(writer)
        return False
    if mode == "close":
        writer.close()
        return False
    if mode == "hang":
        return False  # the caller waits for the peer to go away
    if mode == "not_http":
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\nnot an HTTP answer at all\r\n\r\n")
        return False
    if mode in ("bad_chunked", "bad_chunk_late"):
        head = _head(200, [("content-type", "application/json"), ("transfer-encoding", "chunked")])
        if mode == "bad_chunked":  # in one write: the client reads the bad chunk together with the head
            writer.write(head + b"zz\r\nnot a chunk\r\n")
            return False
        writer.write(head)  # the head alone first, then the bad chunk: the client has returned the response
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.write(b"zz\r\nnot a chunk\r\n")
        return False
    if mode in ENDLESS:
        await _endless(writer, req, rogue)
        return False
    if mode in ("surplus", "unasked"):  # the connection kept alive: the gateway must not reuse it
        body = completion_body(chat)
        # 7 bytes past the Content-Length, or a whole second answer nobody asked for, in the same write.
        writer.write(_full(200, body) + (b"surplus" if mode == "surplus" else _full(200, completion_body(chat))))
        return True
    if mode == "huge_header":
        writer.write(_full(200, completion_body(chat), extra=[("x-huge", "h" * 70_000)]))
        return False
    if mode == "truncated":
        body = completion_body(chat)
        writer.write(_head(200, [("content-type", "application/json"), ("content-length", str(len(body)))]))
        writer.write(body[:20])
        await writer.drain()
        _reset(writer)
        return False
    errors = {
        "error_503": (503, [("retry-after", "7")],
                      b'{"error":{"message":"The engine is overloaded.","type":"ServiceUnavailableError",'
                      b'"param":null,"code":503}}'),
        "error_429": (429, [("retry-after", "3")],
                      b'{"error":{"message":"Too many requests.","type":"RateLimitError","param":null,"code":429}}'),
        "error_405": (405, [], b'{"error":{"message":"Method Not Allowed","type":"Method Not Allowed","param":null,'
                               b'"code":405}}'),
        "error_400_flat": (400, [], b'{"object":"error","message":"flat error","type":"BadRequestError",'
                                    b'"param":null,"code":400}'),
    }
    if mode in errors:
        status, extra, body = errors[mode]
        writer.write(_full(status, body, extra=extra))
        return True
    if mode == "error_500_text":
        writer.write(_full(500, b"Internal Server Error", "text/plain"))
        return True
    if req.stream and mode != "stream_json":
        return await _stream(writer, req, chat)
    plain = {
        "garbage": b"<html>upstream garbage {{{", "json_array": b"[1, 2, 3]", "json_scalar": b'"hello"',
        "json_null": b"null", "empty_200": b"",
    }
    if mode in plain:
        writer.write(_full(200, plain[mode]))
        return True
    body = completion_body(chat) if "completions" in req.target or "responses" in req.target else _echo(req)
    if mode == "gzip":
        writer.write(_full(200, gzip.compress(body), extra=[("content-encoding", "gzip")]))
        return True
    writer.write(_full(200, body))
    return True


def _echo(req: Request) -> bytes:
    if req.target.startswith("/tokenize"):
        return json.dumps({"count": 3, "max_model_len": MAX_MODEL_LEN, "tokens": [1, 2, 3], "token_strs": None}
                          ).encode()
    return json.dumps({"path": req.target, "method": req.method}).encode()


# -- the server --------------------------------------------------------------------------------------
class _Server:
    def __init__(self, rogue: Rogue) -> None:
        self.rogue = rogue
        self.writers: set[asyncio.StreamWriter] = set()
        self.idle: set[asyncio.StreamWriter] = set()  # waiting for a next request

    async def drop_idle(self) -> None:
        for writer in list(self.idle):
            writer.transport.abort()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.rogue.accept_and_close:
            writer.close()
            return
        self.writers.add(writer)
        try:
            while True:
                self.idle.add(writer)
                try:
                    req = await _read_request(reader)
                finally:
                    self.idle.discard(writer)
                if req is None:
                    break
                self.rogue.seen.append(Seen(req.method, req.target, req.headers, req.body))
                keep = await _answer(writer, req, self.rogue)
                if writer.transport.is_closing():
                    break
                await writer.drain()
                if not keep:
                    if req.mode == "hang":
                        with contextlib.suppress(ConnectionError):
                            await reader.read()  # until the gateway gives up and closes
                    writer.close()
                    break
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            self.writers.discard(writer)
            if not writer.transport.is_closing():
                writer.close()


@contextlib.contextmanager
def run_rogue() -> Iterator[Rogue]:
    rogue = Rogue()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    rogue.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    loop = asyncio.new_event_loop()
    server = _Server(rogue)
    rogue._server, rogue._loop = server, loop
    started = threading.Event()
    stop: asyncio.Event | None = None

    async def serve() -> None:
        nonlocal stop
        stop = asyncio.Event()
        srv = await asyncio.start_server(server.handle, sock=sock)
        started.set()
        await stop.wait()
        srv.close()
        for w in list(server.writers):
            w.transport.abort()
        await srv.wait_closed()

    thread = threading.Thread(target=lambda: loop.run_until_complete(serve()), name="rogue-upstream", daemon=True)
    thread.start()
    if not started.wait(10):
        raise RuntimeError("the rogue upstream did not start")
    try:
        yield rogue
    finally:
        assert stop is not None
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        # Cancel what is left (handlers of hung connections) before closing the loop.
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()
        sock.close()
        time.sleep(0)
