"""Connection limits: what one client may hold (headers, time, connections, body), each answered in OpenAI's
shape with the connection closed; ordinary traffic is untouched. Raw sockets on loopback, small bounds."""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import ClientDisconnect, Request

from gateway.config import Settings
from gateway.errors import PayloadTooLarge, RequestTimeout
from gateway.http.body import BodyLimits, read_body
from gateway.http.errors import error_headers
from gateway.http.server import GuardProtocol
from gateway.http.serving import server_config
from testing.gateway_thread import GatewayServer, run_gateway
from testing.vllm_sim import SimConfig, SimServer, run_sim_server

# Small bounds so that no test waits long.
HEADER_BYTES = 4096
HEADERS = 20
HEADER_TIMEOUT = 0.6  # as long as KEEP_ALIVE: a fresh connection waits for its first request min(both)
KEEP_ALIVE = 0.6  # well past BODY_GRACE: a test sleeps past the body deadline on a kept-alive connection
BODY_BYTES = 64 * 1024
BODY_TIMEOUT = 1.0
BODY_GRACE = 0.2
BODY_RATE = 1000.0
SLACK = 1.5  # seconds a close may come after its bound on a busy machine

CHAT = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()


@pytest.fixture(scope="module")
def sim(tokenizer: Any, tokenizer_dir: Path) -> Iterator[SimServer]:
    config = SimConfig(
        model="tiny", root=str(tokenizer_dir), max_model_len=512, num_blocks=256, block_size=16, tokenizer=tokenizer
    )
    with run_sim_server(config) as server:
        yield server


def limited_settings(tokenizer_dir: Path, sim: SimServer, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "tokenizer": str(tokenizer_dir), "upstream": sim.url, "scrape_interval": 0.05, "read_timeout": 5.0,
        "max_header_bytes": HEADER_BYTES, "max_headers": HEADERS, "header_timeout": HEADER_TIMEOUT,
        "keep_alive_timeout": KEEP_ALIVE, "max_body_bytes": BODY_BYTES, "body_timeout": BODY_TIMEOUT,
        "body_rate_grace": BODY_GRACE, "min_body_rate": BODY_RATE,
    }
    values.update(overrides)
    return Settings(**values)


@pytest.fixture(scope="module")
def gateway(sim: SimServer, tokenizer_dir: Path) -> Iterator[GatewayServer]:
    with run_gateway(limited_settings(tokenizer_dir, sim)) as gw:
        yield gw


@pytest.fixture
def gw(gateway: GatewayServer) -> Iterator[GatewayServer]:
    """The module's gateway, checked healthy with its ledger at zero after each test."""
    yield gateway
    assert_healthy(gateway)


# -- raw HTTP -------------------------------------------------------------------------------------
@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def connect(gw: GatewayServer) -> socket.socket:
    port = int(gw.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def parse(raw: bytes) -> Reply:
    head, sep, body = raw.partition(b"\r\n\r\n")
    assert sep, f"no complete response in {raw[:200]!r}"
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        assert name.strip().lower() not in headers, f"{name} twice in {head!r}"
        headers[name.strip().lower()] = value.strip()
    return Reply(int(lines[0].split()[1]), headers, body)


def read_to_eof(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything until the server closes; fails if it does not close within ``timeout``."""
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def read_reply(sock: socket.socket) -> Reply:
    """One response framed by its Content-Length, leaving the connection open. Reads byte-exact (peeking
    first), so that pipelined responses stay in the socket for the next call."""
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        peeked = sock.recv(65536, socket.MSG_PEEK)
        assert peeked, "the server closed before answering"
        end = (head + peeked).find(b"\r\n\r\n")
        head += sock.recv(len(peeked) if end < 0 else end + 4 - len(head))
    reply = parse(head)
    length = int(reply.headers["content-length"])
    while len(reply.body) < length:
        chunk = sock.recv(length - len(reply.body))
        assert chunk, "the server closed inside a response"
        reply.body += chunk
    return reply


def exchange(gw: GatewayServer, payload: bytes) -> Reply:
    """Send ``payload``, read until the server closes the connection (which every refusal must do)."""
    with connect(gw) as sock:
        sock.sendall(payload)
        return parse(read_to_eof(sock))


def post(path: str, body: bytes = CHAT, extra: bytes = b"") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
    return head.encode() + extra + b"\r\n" + body


HEALTH = b"GET /health HTTP/1.1\r\nhost: gw\r\n\r\n"


def assert_openai_error(reply: Reply, status: int, code: str) -> None:
    assert reply.status == status, reply
    assert reply.headers["content-type"] == "application/json"
    assert reply.headers["connection"] == "close"
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert error["message"]


def assert_healthy(gw: GatewayServer) -> None:
    with connect(gw) as sock:
        sock.sendall(HEALTH)
        assert read_reply(sock).status == 200
    deadline = time.monotonic() + 5
    while True:
        status = gw.status()
        if status["committed_blocks"] == status["in_flight"] == status["queued"] == 0:
            return
        assert time.monotonic() < deadline, status
        time.sleep(0.02)


# -- refused heads and declared bodies ------------------------------------------------------------
def headers_of(count: int, size: int) -> bytes:
    return b"".join(b"x-h%d: %s\r\n" % (i, b"v" * size) for i in range(count))


REFUSED = [
    pytest.param(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: 1%s\r\n\r\n" % (b"0" * 20),
                 413, "request_too_large", id="content-length-10^20"),
    pytest.param(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: 10000000000000000000\r\n\r\n",
                 413, "request_too_large", id="content-length-10^19"),
    pytest.param(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: %d\r\n\r\n" % (BODY_BYTES + 1),
                 413, "request_too_large", id="content-length-one-over-the-limit"),
    pytest.param(b"GET /health HTTP/1.1\r\nhost: gw\r\ncontent-length: 999999999\r\n\r\n",
                 413, "request_too_large", id="content-length-over-the-limit-on-a-bodyless-route"),
    pytest.param(post("/v1/chat/completions", extra=b"x-big: " + b"a" * HEADER_BYTES + b"\r\n"),
                 431, "headers_too_large", id="one-header-over-the-byte-limit"),
    pytest.param(post("/v1/chat/completions", extra=headers_of(12, 400)),
                 431, "headers_too_large", id="headers-together-over-the-byte-limit"),
    pytest.param(post("/v1/chat/completions", extra=headers_of(HEADERS, 1)),
                 431, "headers_too_large", id="more-headers-than-the-limit"),
    pytest.param(b"GET /health?" + b"q" * HEADER_BYTES + b" HTTP/1.1\r\nhost: gw\r\n\r\n",
                 431, "headers_too_large", id="request-line-over-the-byte-limit"),
    pytest.param(b"GARBAGE\r\n\r\n", 400, "malformed_request", id="garbage-request-line"),
    pytest.param(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 400, "malformed_request", id="tls-to-plain-port"),
    pytest.param(b"GET /health HTTP/9.9\r\n\r\n", 400, "malformed_request", id="unknown-http-version"),
    pytest.param(b"GET /health HTTP/1.1\nhost: gw\n\n", 400, "malformed_request", id="bare-lf-line-endings"),
    pytest.param(b"GET /health HTTP/1.1\r\nbad header: x\r\n\r\n", 400, "malformed_request", id="space-in-name"),
    pytest.param(b"GET /health HTTP/1.1\r\nx-a: a\x00b\r\n\r\n", 400, "malformed_request", id="nul-in-value"),
    pytest.param(b"GET /health HTTP/1.1\r\nx-a: a\r\n folded\r\n\r\n", 400, "malformed_request",
                 id="obsolete-line-folding"),
    pytest.param(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: -1\r\n\r\n",
                 400, "malformed_request", id="negative-content-length"),
    pytest.param(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
                 400, "malformed_request", id="two-content-lengths"),
    pytest.param(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: 4\r\n"
                 b"transfer-encoding: chunked\r\n\r\n", 400, "malformed_request", id="content-length-and-chunked"),
    pytest.param(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
                 400, "malformed_request", id="invalid-chunk-size"),
    pytest.param(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ntransfer-encoding: chunked\r\n\r\n"
                 b"5\r\n{\"a\":\r\n3\r\n1}\r\n", 400, "malformed_request",
                 id="chunk-longer-than-its-size-while-the-app-reads-the-body"),
]


@pytest.mark.parametrize(("payload", "status", "code"), REFUSED)
def test_a_refused_request_is_answered_in_openai_shape_and_closed(
    gw: GatewayServer, payload: bytes, status: int, code: str
) -> None:
    assert_openai_error(exchange(gw, payload), status, code)


def test_an_endless_header_sent_in_pieces_is_cut_at_the_limit_and_still_answered(gw: GatewayServer) -> None:
    with connect(gw) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nx-endless: ")
        for _ in range(4 * HEADER_BYTES // 512):
            sock.sendall(b"a" * 512)  # the server discards what follows its answer instead of resetting
            time.sleep(0.005)
        reply = parse(read_to_eof(sock))
    assert_openai_error(reply, 431, "headers_too_large")


def test_the_answers_say_which_limit_and_what_was_given(gw: GatewayServer) -> None:
    too_many = exchange(gw, post("/v1/chat/completions", extra=headers_of(HEADERS, 1))).json()["error"]["message"]
    assert f"has {HEADERS + 3} headers; the limit is {HEADERS}" in too_many
    too_large = exchange(gw, b"POST /v1/completions HTTP/1.1\r\ncontent-length: 70000\r\n\r\n").json()
    assert "70000" in too_large["error"]["message"] and str(BODY_BYTES) in too_large["error"]["message"]


# -- ordinary traffic -----------------------------------------------------------------------------
def test_a_chat_with_many_ordinary_headers_is_served(gw: GatewayServer) -> None:
    extra = headers_of(HEADERS - 5, 100)  # with host, content-type and content-length: just under both limits
    with connect(gw) as sock:
        sock.sendall(post("/v1/chat/completions", extra=extra))
        reply = read_reply(sock)
    assert reply.status == 200, reply
    assert reply.json()["choices"]


def test_a_keep_alive_connection_serves_request_after_request(gw: GatewayServer) -> None:
    with connect(gw) as sock:
        for payload in [HEALTH, post("/v1/chat/completions"), HEALTH, post("/v1/chat/completions")]:
            sock.sendall(payload)
            assert read_reply(sock).status == 200
            time.sleep(KEEP_ALIVE / 3)  # idle between requests, within the bound


def test_pipelined_requests_are_answered_in_order(gw: GatewayServer) -> None:
    with connect(gw) as sock:
        sock.sendall(HEALTH + post("/v1/chat/completions") + HEALTH)
        assert [read_reply(sock).status for _ in range(3)] == [200, 200, 200]


@pytest.mark.parametrize(
    ("after", "status", "code"),
    [
        pytest.param(b"GARBAGE\r\n\r\n", 400, "malformed_request", id="garbage"),
        pytest.param(b"GET /health HTTP/1.1\r\nx-a: " + b"a" * HEADER_BYTES + b"\r\n\r\n", 431, "headers_too_large",
                     id="headers-too-large"),
        pytest.param(b"GET /health HTTP/1.1\r\nhost: gw\r\n", 408, "request_timeout", id="a-head-that-stalls"),
    ],
)
def test_a_refusal_pipelined_after_a_good_request_follows_its_answer(
    gw: GatewayServer, after: bytes, status: int, code: str
) -> None:
    with connect(gw) as sock:
        sock.sendall(post("/v1/chat/completions") + after)
        assert read_reply(sock).status == 200
        assert_openai_error(parse(read_to_eof(sock)), status, code)


def test_a_body_that_keeps_pace_past_the_grace_is_served(gw: GatewayServer) -> None:
    padded = json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "user": "u" * 1500}
    ).encode()
    with connect(gw) as sock:
        sock.sendall(post("/v1/chat/completions", padded)[: -len(padded)])
        for i in range(0, len(padded), 150):  # 3,000 bytes/s for 0.5 s, against 1,000 after a 0.2 s grace
            sock.sendall(padded[i:i + 150])
            time.sleep(0.05)
        assert read_reply(sock).status == 200


def test_an_upgrade_request_is_served_as_plain_http_on_a_connection_that_stays_usable(gw: GatewayServer) -> None:
    upgrade = b"GET /health HTTP/1.1\r\nhost: gw\r\nconnection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\n" \
              b"http2-settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n"
    with connect(gw) as sock:
        sock.sendall(upgrade)
        assert read_reply(sock).status == 200
        time.sleep(BODY_GRACE + 0.1)  # past any body deadline: none applies to a request without a body
        sock.sendall(HEALTH)
        assert read_reply(sock).status == 200


# -- idle and slow clients ------------------------------------------------------------------------
def closes_within(sock: socket.socket, bound: float) -> bytes:
    started = time.monotonic()
    data = read_to_eof(sock, timeout=bound + SLACK)
    assert time.monotonic() - started < bound + SLACK
    return data


def test_fresh_connections_that_send_nothing_are_closed_silently(gw: GatewayServer) -> None:
    socks = [connect(gw) for _ in range(50)]
    try:
        assert all(closes_within(sock, KEEP_ALIVE) == b"" for sock in socks)
    finally:
        for sock in socks:
            sock.close()


def test_a_connection_idle_after_its_response_is_closed(gw: GatewayServer) -> None:
    with connect(gw) as sock:
        sock.sendall(HEALTH)
        assert read_reply(sock).status == 200
        assert closes_within(sock, KEEP_ALIVE) == b""


def test_with_a_long_keep_alive_a_fresh_connection_still_sends_its_request_within_the_header_timeout(
    sim: SimServer, tokenizer_dir: Path
) -> None:
    """The keep-alive outlasts the clients' pools (120 s by default) for connections kept after an answer; one
    just opened that sends nothing is closed after --header-timeout, as a slow head would be."""
    with run_gateway(limited_settings(tokenizer_dir, sim, keep_alive_timeout=120.0)) as gw:
        with connect(gw) as fresh:
            assert closes_within(fresh, HEADER_TIMEOUT) == b""
        with connect(gw) as kept:
            kept.sendall(HEALTH)
            assert read_reply(kept).status == 200
            time.sleep(2 * HEADER_TIMEOUT)  # idle past the header timeout, well within the keep-alive
            kept.sendall(HEALTH)
            assert read_reply(kept).status == 200


SLOW = [
    pytest.param(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncont", HEADER_TIMEOUT,
                 id="headers-half-sent"),
    pytest.param(b"P", HEADER_TIMEOUT, id="one-byte-of-request-line"),
    pytest.param(post("/v1/chat/completions", CHAT)[:-10], BODY_GRACE + BODY_TIMEOUT, id="body-stalls"),
    pytest.param(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ntransfer-encoding: chunked\r\n\r\n4\r\n{\"a\"\r\n",
                 BODY_GRACE + BODY_TIMEOUT, id="chunked-body-stalls"),
]


@pytest.mark.parametrize(("payload", "bound"), SLOW)
def test_a_client_that_stops_sending_gets_408_and_is_closed(gw: GatewayServer, payload: bytes, bound: float) -> None:
    with connect(gw) as sock:
        sock.sendall(payload)
        reply = parse(closes_within(sock, bound))
    assert_openai_error(reply, 408, "request_timeout")


def trickle(sock: socket.socket, piece: bytes, every: float, limit: float) -> Reply:
    """Send ``piece`` every ``every`` seconds until the server answers (or ``limit`` passes)."""
    started = time.monotonic()
    while time.monotonic() - started < limit:
        if select.select([sock], [], [], every)[0]:
            break
        sock.sendall(piece)
    return parse(read_to_eof(sock))


def test_a_chunked_body_that_never_ends_is_cut_at_the_body_timeout(gw: GatewayServer) -> None:
    with connect(gw) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ntransfer-encoding: chunked\r\n\r\n")
        started = time.monotonic()
        reply = trickle(sock, b"1f4\r\n" + b" " * 500 + b"\r\n", 0.05, BODY_TIMEOUT + SLACK)  # 10 KB/s: fast enough
    assert_openai_error(reply, 408, "request_timeout")
    assert BODY_TIMEOUT * 0.9 < time.monotonic() - started < BODY_TIMEOUT + SLACK
    assert f"{BODY_TIMEOUT:g} seconds" in reply.json()["error"]["message"]


def test_a_body_slower_than_the_minimum_rate_is_cut_after_the_grace(gw: GatewayServer) -> None:
    with connect(gw) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: 60000\r\n\r\n")
        started = time.monotonic()
        reply = trickle(sock, b" ", 0.02, BODY_TIMEOUT + SLACK)  # 50 bytes/s
    assert_openai_error(reply, 408, "request_timeout")
    assert time.monotonic() - started < BODY_TIMEOUT  # the rate, not the total, cut it
    assert "bytes per second" in reply.json()["error"]["message"]


# -- the connection cap ---------------------------------------------------------------------------
def test_connections_beyond_the_cap_get_503_in_openai_shape_until_one_closes(
    sim: SimServer, tokenizer_dir: Path
) -> None:
    settings = limited_settings(tokenizer_dir, sim, max_connections=3, keep_alive_timeout=10.0)
    with run_gateway(settings) as gw:
        held = [connect(gw) for _ in range(3)]
        try:
            held[0].sendall(HEALTH)
            assert read_reply(held[0]).status == 200
            reply = exchange(gw, HEALTH)
            assert_openai_error(reply, 503, "too_many_connections")
            assert reply.headers["retry-after"] == "1"
            assert "3 connections" in reply.json()["error"]["message"]
            held.pop().close()
            deadline = time.monotonic() + 5
            while True:  # the server notices the close on one of its next loop turns
                with connect(gw) as sock:
                    sock.sendall(HEALTH)
                    status = read_reply(sock).status
                if status == 200 or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            assert status == 200
            assert_healthy_under_cap(held)
        finally:
            for sock in held:
                sock.close()


def assert_healthy_under_cap(held: list[socket.socket]) -> None:
    """The connections held all along still serve requests."""
    for sock in held:
        sock.sendall(HEALTH)
        assert read_reply(sock).status == 200


# -- read_body on its own, with an injected clock ---------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fake_request(messages: list[tuple[float, dict[str, Any]]], clock: Clock, declared: int | None = None) -> Request:
    """Each message arrives after its delay (in the clock's time, instantly in real time)."""
    pending = list(messages)

    async def receive() -> dict[str, Any]:
        delay, message = pending.pop(0)
        clock.now += delay
        return message

    headers = [(b"content-length", str(declared).encode())] if declared is not None else []
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers}, receive)


def body(chunk: bytes, more: bool = True) -> dict[str, Any]:
    return {"type": "http.request", "body": chunk, "more_body": more}


LIMITS = BodyLimits(max_bytes=1000, timeout=30.0, min_rate=10.0, grace=5.0)

READS = [
    pytest.param([(0, body(b"abc", False))], None, b"abc", id="one-chunk"),
    pytest.param([(0, body(b"ab")), (1, body(b"")), (1, body(b"cd", False))], None, b"abcd", id="chunks-joined"),
    pytest.param([(4.9, body(b"", False))], None, b"", id="slow-start-within-the-grace"),
    pytest.param([(0, body(b"x" * 100)), (14.0, body(b"y", False))], None, b"x" * 100 + b"y",
                 id="rate-kept-by-a-burst-early-on"),
    pytest.param([(29.9, body(b"x" * 300, False))], None, b"x" * 300, id="just-within-the-total"),
    pytest.param([(0, body(b"x" * 1000, False))], 1000, b"x" * 1000, id="exactly-the-limit"),
]


@pytest.mark.parametrize(("messages", "declared", "expected"), READS)
async def test_read_body_returns_a_body_that_arrives_in_time(
    messages: list[tuple[float, dict[str, Any]]], declared: int | None, expected: bytes
) -> None:
    clock = Clock()
    assert await read_body(fake_request(messages, clock, declared), LIMITS, clock) == expected


REFUSED_READS = [
    pytest.param([(30.1, body(b"x" * 999, False))], None, RequestTimeout, "within 30 seconds",
                 id="ends-after-the-total"),
    pytest.param([(0, body(b"x" * 100)), (16.0, body(b"y"))], None, RequestTimeout, "bytes per second",
                 id="slower-than-the-rate-after-the-grace"),
    pytest.param([(6.0, body(b"", False))], None, RequestTimeout, "bytes per second", id="nothing-past-the-grace"),
    pytest.param([], 1001, PayloadTooLarge, "1001 bytes", id="declared-over-the-limit"),
    pytest.param([(0, body(b"x" * 600)), (0, body(b"x" * 600))], None, PayloadTooLarge, "1000 bytes",
                 id="chunks-over-the-limit"),
]


@pytest.mark.parametrize(("messages", "declared", "error", "words"), REFUSED_READS)
async def test_read_body_refuses_a_body_too_slow_or_too_large_and_closes(
    messages: list[tuple[float, dict[str, Any]]], declared: int | None, error: type[Exception], words: str
) -> None:
    clock = Clock()
    with pytest.raises(error) as caught:
        await read_body(fake_request(messages, clock, declared), LIMITS, clock)
    assert words in str(caught.value)
    assert caught.value.close_connection and error_headers(caught.value)["connection"] == "close"


async def test_read_body_reports_a_client_that_went_away() -> None:
    clock = Clock()
    with pytest.raises(ClientDisconnect):
        await read_body(fake_request([(0, body(b"ab")), (0, {"type": "http.disconnect"})], clock), LIMITS, clock)


# -- the production server ------------------------------------------------------------------------
def test_the_server_is_built_with_the_settings_limits() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError

    settings = Settings(max_headers=7, header_timeout=2.5, max_connections=9, max_body_bytes=4096)
    config = server_config(app, settings)
    assert isinstance(config.http, type) and issubclass(config.http, GuardProtocol)
    limits = config.http.limits
    assert (limits.max_headers, limits.header_timeout, limits.max_connections) == (7, 2.5, 9)
    assert limits.body.max_bytes == 4096
    assert config.ws == "none"
    assert config.access_log is False and config.limit_concurrency is None
