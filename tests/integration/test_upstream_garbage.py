"""A misbehaving upstream never reaches the client as a 200 it cannot use, compressed bytes labelled as plain, a
non-OpenAI error type, or a lost Retry-After; and every reservation is released."""

from __future__ import annotations

import gzip
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.config import Settings
from testing.bad_upstream import (
    Answer,
    BadUpstream,
    chunked,
    full,
    is_one_whole_event,
    raw_request,
    run_bad_upstream,
)
from testing.gateway_thread import GatewayServer, run_gateway

COMPLETION = orjson.dumps({
    "id": "cmpl-1", "object": "text_completion", "created": 1, "model": "tiny",
    "choices": [{"index": 0, "text": "fine", "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
})
EVENTS = [b'data: {"choices":[{"index":0,"text":"a"}]}\n\n', b'data: {"choices":[{"index":0,"text":"b"}]}\n\n',
          b"data: [DONE]\n\n"]
HTML_502 = (b"<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n<center><h1>502 Bad Gateway</h1>"
            b"</center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n")


def vllm_error(message: str, etype: str, code: int) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": etype, "param": None, "code": code}})


GZIP = (("content-encoding", "gzip"),)


@pytest.fixture(scope="module")
def upstream() -> Iterator[BadUpstream]:
    with run_bad_upstream() as server:
        yield server


@pytest.fixture(scope="module")
def gateway(upstream: BadUpstream, tokenizer_dir: Path) -> Iterator[GatewayServer]:
    settings = Settings(tokenizer=str(tokenizer_dir), scrape_interval=0.05, queue_timeout=5.0, read_timeout=5.0)
    with run_gateway(settings, upstream=upstream.url) as gw:
        yield gw


def wait_for_empty_ledger(gw: GatewayServer) -> None:
    deadline = time.monotonic() + 5
    while True:
        status = httpx.get(gw.url + "/guard/status").json()
        if status["committed_blocks"] == 0 and status["in_flight"] == 0 and status["queued"] == 0:
            return
        assert time.monotonic() < deadline, f"the ledger did not return to zero: {status}"
        time.sleep(0.01)


def assert_openai_error(body: Any, etype: str, code: str | None) -> dict[str, Any]:
    error: dict[str, Any] = body["error"]
    assert set(body) == {"error"} and set(error) == {"message", "type", "param", "code"}, body
    assert error["message"] and (error["type"], error["code"]) == (etype, code), error
    return error


# (case, the upstream's answer, status, error type, error code, Retry-After expected)
ANSWERS: list[tuple[str, Answer, int, str | None, str | None, str | None]] = [
    ("JSON array", full(200, b"[1, 2]"), 502, "server_error", "bad_upstream_response", None),
    ("JSON null", full(200, b"null"), 502, "server_error", "bad_upstream_response", None),
    ("JSON string", full(200, b'"fine"'), 502, "server_error", "bad_upstream_response", None),
    ("garbage bytes", full(200, b"\x00\xff\x13 not json"), 502, "server_error", "bad_upstream_response", None),
    ("empty 200", full(200, b""), 502, "server_error", "bad_upstream_response", None),
    ("HTML 200", full(200, b"<html>hi</html>", "text/html"), 502, "server_error", "bad_upstream_response", None),
    ("202 instead of 200", full(202, COMPLETION), 502, "server_error", "bad_upstream_response", None),
    ("gzip body", full(200, gzip.compress(COMPLETION), headers=GZIP), 200, None, None, None),
    ("deflate body", full(200, zlib.compress(COMPLETION), headers=(("content-encoding", "deflate"),)),
     200, None, None, None),
    ("brotli body", full(200, b"\x1b\x03\x00", headers=(("content-encoding", "br"),)),
     502, "server_error", "bad_upstream_response", None),
    ("gzip label on plain bytes", full(200, COMPLETION, headers=GZIP), 502, "server_error", "bad_upstream_response",
     None),
    ("truncated gzip", full(200, gzip.compress(COMPLETION)[:-12], headers=GZIP),
     502, "server_error", "bad_upstream_response", None),
    ("503 with Retry-After", full(503, vllm_error("busy", "ServiceUnavailableError", 503),
                                  headers=(("retry-after", "7"),)), 503, "server_error", None, "7"),
    ("429 with Retry-After", full(429, vllm_error("slow down", "TooManyRequests", 429),
                                  headers=(("retry-after", "3"),)), 429, "rate_limit_error", None, "3"),
    ("503 HTML page with Retry-After", full(503, b"<html><title>Down</title></html>", "text/html",
                                            headers=(("Retry-After", "11"),)), 503, "server_error", None, "11"),
    ("Retry-After that is not a delay", full(503, b"{}", headers=(("retry-after", "soon\x7f"),)),
     503, "server_error", None, None),
    ("405 as FastAPI words it", full(405, b'{"detail":"Method Not Allowed"}'),
     405, "invalid_request_error", None, None),
    ("405 as vLLM words it", full(405, vllm_error("Method Not Allowed", "Method Not Allowed", 405)),
     405, "invalid_request_error", None, None),
    ("404 Not Found", full(404, vllm_error("Not Found", "Not Found", 404)), 404, "invalid_request_error", None, None),
    ("400 BadRequestError", full(400, vllm_error("bad temperature", "BadRequestError", 400)),
     400, "invalid_request_error", None, None),
    ("401 from the upstream", full(401, b'{"error": "Unauthorized"}'), 401, "authentication_error", None, None),
    ("500 InternalServerError", full(500, vllm_error("boom", "InternalServerError", 500)),
     500, "server_error", None, None),
    ("502 nginx HTML page", full(502, HTML_502, "text/html"), 502, "server_error", None, None),
]


@pytest.mark.parametrize(("case", "answer", "status", "etype", "code", "retry_after"), ANSWERS,
                         ids=[a[0] for a in ANSWERS])
def test_a_guarded_request_gets_a_usable_answer_or_an_openai_error(
    gateway: GatewayServer, upstream: BadUpstream, case: str, answer: Answer, status: int, etype: str | None,
    code: str | None, retry_after: str | None,
) -> None:
    upstream.answer = answer
    r = httpx.post(gateway.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3},
                   timeout=15)
    assert r.status_code == status, r.text
    assert upstream.requests()[-1].headers["accept-encoding"] == "identity"
    if status == 200:
        assert "content-encoding" not in r.headers and r.content == COMPLETION
    else:
        error = assert_openai_error(r.json(), etype or "", code)
        assert "<" not in error["message"], error  # a page's title, never its markup
        assert r.headers.get("retry-after") == retry_after
    wait_for_empty_ledger(gateway)


STREAM_ANSWERS: list[tuple[str, Answer, int, str | None, str | None]] = [
    ("JSON 200 to a stream request", full(200, COMPLETION), 502, "server_error", "bad_upstream_response"),
    ("HTML 200 to a stream request", full(200, b"<html></html>", "text/html"), 502, "server_error",
     "bad_upstream_response"),
    ("brotli stream", chunked([b"\x1b\x03"], headers=(("content-encoding", "br"),)), 502, "server_error",
     "bad_upstream_response"),
    ("503 with Retry-After to a stream request", full(503, vllm_error("busy", "ServiceUnavailableError", 503),
                                                      headers=(("retry-after", "4"),)), 503, "server_error", None),
]


@pytest.mark.parametrize(("case", "answer", "status", "etype", "code"), STREAM_ANSWERS,
                         ids=[a[0] for a in STREAM_ANSWERS])
def test_a_stream_request_answered_with_no_stream_gets_an_openai_error(
    gateway: GatewayServer, upstream: BadUpstream, case: str, answer: Answer, status: int, etype: str,
    code: str | None,
) -> None:
    upstream.answer = answer
    r = httpx.post(gateway.url + "/v1/completions",
                   json={"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": True}, timeout=15)
    assert r.status_code == status, r.text
    assert_openai_error(r.json(), etype, code)
    if status == 503:
        assert r.headers["retry-after"] == "4"
    wait_for_empty_ledger(gateway)


def stream_request(gw: GatewayServer) -> list[bytes]:
    reply = raw_request(gw.url, "/v1/completions",
                        orjson.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": True}))
    assert reply.status == 200 and "content-encoding" not in reply.headers
    assert all(is_one_whole_event(w) for w in reply.chunks), reply.chunks
    wait_for_empty_ledger(gw)
    return reply.chunks


def test_a_gzip_stream_is_decoded_and_relayed_as_plain_events(gateway: GatewayServer, upstream: BadUpstream) -> None:
    packed = gzip.compress(b"".join(EVENTS))
    upstream.answer = chunked([packed[i : i + 9] for i in range(0, len(packed), 9)], headers=GZIP)
    assert stream_request(gateway) == EVENTS


def test_a_gzip_stream_cut_short_ends_with_an_error_event(gateway: GatewayServer, upstream: BadUpstream) -> None:
    squeeze = zlib.compressobj(wbits=31)
    packed = squeeze.compress(b"".join(EVENTS[:2])) + squeeze.flush(zlib.Z_SYNC_FLUSH)  # no gzip trailer
    upstream.answer = chunked([packed], headers=GZIP)
    writes = stream_request(gateway)
    assert writes[:2] == EVENTS[:2] and writes[-1] == b"data: [DONE]\n\n"
    assert_openai_error(orjson.loads(writes[2][6:]), "server_error", "bad_upstream_response")


# -- pass-through routes (/detokenize: the gateway answers /tokenize itself when it has the tokenizer) ----------
def test_a_pass_through_keeps_the_upstream_retry_after_and_sends_identity(
    gateway: GatewayServer, upstream: BadUpstream
) -> None:
    upstream.answer = full(503, vllm_error("busy", "ServiceUnavailableError", 503), headers=(("retry-after", "6"),))
    r = httpx.post(gateway.url + "/detokenize", json={"model": "tiny", "tokens": [7]},
                   headers={"accept-encoding": "gzip, br"})
    assert r.status_code == 503 and r.headers["retry-after"] == "6"
    assert_openai_error(r.json(), "server_error", None)
    assert upstream.requests()[-1].headers["accept-encoding"] == "identity"


def test_a_pass_through_405_gets_an_openai_type(gateway: GatewayServer, upstream: BadUpstream) -> None:
    upstream.answer = full(405, vllm_error("Method Not Allowed", "Method Not Allowed", 405))
    r = httpx.post(gateway.url + "/detokenize", json={"model": "tiny", "tokens": [7]})
    assert r.status_code == 405
    assert_openai_error(r.json(), "invalid_request_error", None)


def test_a_compressed_pass_through_body_keeps_its_content_encoding(
    gateway: GatewayServer, upstream: BadUpstream
) -> None:
    body = b'{"prompt": "hi"}'
    upstream.answer = full(200, gzip.compress(body), headers=GZIP)
    reply = raw_request(gateway.url, "/detokenize", b'{"model": "tiny", "tokens": [7]}')
    assert reply.status == 200 and reply.headers["content-encoding"] == "gzip"
    assert gzip.decompress(reply.body) == body
