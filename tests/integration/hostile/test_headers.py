"""Headers: size and count limits (431), bad guard headers (400), request ids, content types and lying
Content-Lengths. Sent over raw sockets, byte for byte, so that no client library tidies them first."""

from __future__ import annotations

import asyncio
import gzip
import json

import pytest

from testing.hostile_checks import (
    Case,
    Target,
    check_answer,
    close_writer,
    dumps,
    host_port,
    raw_exchange,
    read_response,
    request_bytes,
    statuses,
    table,
)

from .conftest import CLIENT_KEY, NORMAL_CHAT

CHAT = "/v1/chat/completions"
BODY = dumps(NORMAL_CHAT)
AUTH = ("authorization", f"Bearer {CLIENT_KEY}")
JSON = ("content-type", "application/json")
CLOSE = ("connection", "close")
OK = statuses(200)


def with_headers(id: str, *headers: tuple[str, str], status: frozenset[int] = OK, param: str | None = None,
                 code: str | None = None, body: bytes = BODY) -> Case:
    return Case(id, body, CHAT, headers=(AUTH, JSON, CLOSE, *headers), status=status, param=param, code=code)


def raw(id: str, data: bytes, status: frozenset[int], code: str | None = None) -> Case:
    """A request written out whole (``body`` holds every byte), for what no header list can express."""
    return Case(id, data, "", "RAW", status=status, code=code)


def head(*lines: str, body: bytes = BODY, first: str = f"POST {CHAT} HTTP/1.1") -> bytes:
    fixed = [first, "host: 127.0.0.1", f"authorization: Bearer {CLIENT_KEY}", "content-type: application/json",
             "connection: close", *lines]
    return ("\r\n".join(fixed) + "\r\n\r\n").encode("latin-1") + body


SIZE_AND_COUNT = [
    with_headers("one header of 64 KB", ("x-big", "a" * 64 * 1024), status=statuses(431)),
    with_headers("one header of 1 MB", ("x-big", "a" * 1024 * 1024), status=statuses(431)),
    with_headers("four headers of 16 KB", *[(f"x-big-{i}", "b" * 16 * 1024) for i in range(4)],
                 status=statuses(431)),
    with_headers("200 small headers", *[(f"x-h-{i}", "v") for i in range(200)], status=statuses(431)),
    with_headers("2000 small headers", *[(f"x-h-{i}", "v") for i in range(2000)], status=statuses(431)),
    with_headers("80 small headers are fine", *[(f"x-h-{i}", "v") for i in range(80)]),
    with_headers("a header of 4 KB is fine", ("x-big", "c" * 4096)),
    Case("request line of 64 KB", BODY, CHAT + "?" + "q" * 64 * 1024, headers=(AUTH, JSON, CLOSE),
         status=statuses(404, 414, 431)),
]

GUARD_HEADERS = [
    with_headers("priority a word", ("x-guard-priority", "high"), status=statuses(400), param="x-guard-priority"),
    with_headers("priority a decimal", ("x-guard-priority", "1.5"), status=statuses(400), param="x-guard-priority"),
    with_headers("priority empty", ("x-guard-priority", ""), status=statuses(400), param="x-guard-priority"),
    with_headers("priority in hex", ("x-guard-priority", "0x10"), status=statuses(400), param="x-guard-priority"),
    with_headers("priority in exponent form", ("x-guard-priority", "1e3"), status=statuses(400),
                 param="x-guard-priority"),
    with_headers("priority with two signs", ("x-guard-priority", "--1"), status=statuses(400),
                 param="x-guard-priority"),
    with_headers("priority in non-ascii bytes", ("x-guard-priority", "\xef\xbc\x91"), status=statuses(400),
                 param="x-guard-priority"),
    with_headers("priority of 40 digits", ("x-guard-priority", "9" * 40), status=statuses(200, 400)),
    with_headers("priority negative is fine", ("x-guard-priority", "-5")),
    with_headers("priority positive is fine", ("x-guard-priority", "7")),
    with_headers("overflow policy empty", ("x-guard-on-overflow", ""), status=statuses(400),
                 param="x-guard-on-overflow"),
    with_headers("overflow policy upper case", ("x-guard-on-overflow", "TRUNCATE"), status=statuses(400),
                 param="x-guard-on-overflow"),
    with_headers("overflow policy unknown", ("x-guard-on-overflow", "drop"), status=statuses(400),
                 param="x-guard-on-overflow"),
    with_headers("overflow policy a list", ("x-guard-on-overflow", "truncate,reject"), status=statuses(400),
                 param="x-guard-on-overflow"),
    with_headers("overflow policy reject is fine", ("x-guard-on-overflow", "reject")),
]

CONTENT = [
    with_headers("content-type text/plain", ("content-type", "text/plain"), status=statuses(200, 400, 415)),
    Case("content-type missing", BODY, CHAT, headers=(AUTH, CLOSE), status=statuses(200, 400, 415)),
    with_headers("form-encoded body", ("content-type", "application/x-www-form-urlencoded"),
                 body=b"model=tiny&messages=hi", status=statuses(400, 415)),
    with_headers("multipart body", ("content-type", "multipart/form-data; boundary=x"),
                 body=b"--x\r\ncontent-disposition: form-data; name=\"model\"\r\n\r\ntiny\r\n--x--\r\n",
                 status=statuses(400, 415)),
    with_headers("utf-16 declared, utf-8 sent", ("content-type", "application/json; charset=utf-16"),
                 status=statuses(200, 400, 415)),
    with_headers("gzip-encoded body", ("content-encoding", "gzip"), body=gzip.compress(BODY),
                 status=statuses(400, 415)),
    with_headers("expect 100-continue", ("expect", "100-continue")),
]

PROTOCOL = [
    raw("Content-Length of 10^20", head("content-length: 100000000000000000000"), statuses(413)),
    raw("Content-Length beyond the body limit", head("content-length: 10000000", body=b""), statuses(413)),
    raw("Content-Length negative", head("content-length: -1"), statuses(400)),
    raw("Content-Length not a number", head("content-length: abc"), statuses(400)),
    raw("two different Content-Lengths", head(f"content-length: {len(BODY)}", "content-length: 5"), statuses(400)),
    raw("Content-Length and chunked together", head(f"content-length: {len(BODY)}", "transfer-encoding: chunked"),
        statuses(400)),
    raw("Content-Length shorter than the body", head("content-length: 10"), statuses(400)),
    raw("Transfer-Encoding gzip", head("transfer-encoding: gzip"), statuses(400, 501)),
    raw("folded header line", head("x-folded: a", " continued", f"content-length: {len(BODY)}"), statuses(400)),
    raw("space inside a header name", head("x bad: 1", f"content-length: {len(BODY)}"), statuses(400)),
    raw("nul byte in a header value", head("x-nul: a\x00b", f"content-length: {len(BODY)}"), statuses(400)),
    raw("no Host header", ("\r\n".join([f"POST {CHAT} HTTP/1.1", f"authorization: Bearer {CLIENT_KEY}",
                                         "content-type: application/json", "connection: close",
                                         f"content-length: {len(BODY)}"]) + "\r\n\r\n").encode() + BODY,
        statuses(200, 400)),
    raw("HTTP/1.0 without Host", ("\r\n".join([f"POST {CHAT} HTTP/1.0", f"authorization: Bearer {CLIENT_KEY}",
                                                "content-type: application/json",
                                                f"content-length: {len(BODY)}"]) + "\r\n\r\n").encode() + BODY,
        OK),
    raw("HTTP version 9.9", head(f"content-length: {len(BODY)}", first=f"POST {CHAT} HTTP/9.9"),
        statuses(400, 505)),
    raw("HTTP/2 preface on HTTP/1.1", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", statuses(400, 505)),
    raw("binary noise", bytes(range(256)) * 4, statuses(400)),
]

CASES = [*SIZE_AND_COUNT, *GUARD_HEADERS, *CONTENT, *PROTOCOL]


@pytest.mark.parametrize("case", table(CASES))
async def test_a_hostile_header_is_answered_in_openai_shape_and_leaves_the_gateway_well(
    gw: Target, case: Case
) -> None:
    if case.method == "RAW":
        data = case.body or b""
    else:
        data = request_bytes(case.method, case.path, list(case.headers), case.body or b"")
    r = await raw_exchange(gw.url, data)
    assert r is not None, f"{case.id}: the gateway closed the connection without an answer"
    check_answer(r.status, r.body, case)
    gw.still_well()


REQUEST_IDS = [
    ("abc-123.x:y_z", True),
    ("a" * 1000, False),
    ("<script>alert(1)</script>", False),
    ("id with spaces", False),
    ("\xe9t\xe9", False),
    ("", False),
]


@pytest.mark.parametrize(("sent", "kept"), REQUEST_IDS, ids=["plain", "1000 chars", "markup", "spaces",
                                                             "latin-1 bytes", "empty"])
async def test_a_request_id_is_kept_only_when_it_is_safe(gw: Target, sent: str, kept: bool) -> None:
    data = request_bytes("POST", CHAT, [AUTH, JSON, CLOSE, ("x-request-id", sent)], BODY)
    r = await raw_exchange(gw.url, data)
    assert r is not None and r.status == 200, r
    rid = r.headers["x-request-id"]
    assert (rid == sent) is kept
    assert 1 <= len(rid) <= 128 and all(c.isalnum() or c in "._:-" for c in rid)
    gw.still_well()


async def test_a_body_cut_short_by_the_client_is_dropped_without_a_trace(gw: Target) -> None:
    """Content-Length promises more than is sent, then the client stops writing: nothing is held."""
    host, port = host_port(gw.url)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request_bytes("POST", CHAT, [AUTH, JSON, ("content-length", str(len(BODY) + 100))], BODY))
        writer.write_eof()
        r = await asyncio.wait_for(read_response(reader), 5)
        if r is not None:
            check_answer(r.status, r.body, Case("cut short", status=statuses(400, 408)))
    finally:
        await close_writer(writer)
    gw.still_well()


def test_error_bodies_name_no_request_content(gw: Target) -> None:
    """An error never echoes a secret header back (the client's key stays out of messages)."""
    r = gw.client.post(CHAT, content=b"{", headers={"authorization": f"Bearer {CLIENT_KEY}"})
    assert r.status_code == 400
    assert CLIENT_KEY not in r.text
    assert json.loads(r.text)["error"]["type"] == "invalid_request_error"
