"""A misbehaving upstream: resets, hangs, garbage, a JSON array, gzip, broken and oddly framed streams, its own
errors with Retry-After; endless heads, bytes behind an answer, a POST read and dropped, connections closed as
they open. The client always gets an answer in OpenAI's shape (a stream: whole events, and an error event only
between events), at once where the upstream's fault is plain; what the gateway sends upstream is exactly what
the client sent, once; and the next request is never harmed."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import pytest

from testing.hostile_checks import (
    Case,
    RawResponse,
    Target,
    check_answer,
    error_of,
    event_data,
    raw_exchange,
    request_bytes,
    sse_events,
    statuses,
)
from testing.rogue_engine import ENDLESS, ENDLESS_BYTES, Rogue

from .conftest import UPSTREAM_KEY

UNAVAILABLE = statuses(502, 503)
# /detokenize stands for the pass-through routes (/tokenize is answered by the gateway when it has the tokenizer).
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "detokenize": "/detokenize"}


def body_for(route: str, mode: str, *, stream: bool = False, **extra: Any) -> dict[str, Any]:
    tag = f"rogue:{mode}"
    if route == "chat":
        body: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": tag}], "max_tokens": 3}
    elif route == "completions":
        body = {"model": "tiny", "prompt": tag, "max_tokens": 3}
    else:
        body = {"model": "tiny", "tokens": [1, 2], "x": tag}
    if stream:
        body["stream"] = True
    body.update(extra)
    return body


@dataclass(frozen=True)
class Fault:
    id: str
    route: str
    mode: str
    status: frozenset[int]
    code: str | None = None
    retry_after: str | None = None
    error_type: str | None = None

    def case(self) -> Case:
        return Case(self.id, status=self.status, code=self.code)


ANSWERS = [
    Fault("chat ok", "chat", "ok", statuses(200)),
    Fault("chat reset before answering", "chat", "reset", UNAVAILABLE),
    Fault("chat closed before answering", "chat", "close", UNAVAILABLE),
    Fault("chat never answers", "chat", "hang", statuses(504), "upstream_timeout"),
    Fault("chat answers html", "chat", "garbage", statuses(502), "bad_upstream_response"),
    Fault("chat answers something not http", "chat", "not_http", statuses(502)),
    Fault("chat answers a json array", "chat", "json_array", statuses(502), "bad_upstream_response"),
    Fault("chat answers a json string", "chat", "json_scalar", statuses(502), "bad_upstream_response"),
    Fault("chat answers json null", "chat", "json_null", statuses(502), "bad_upstream_response"),
    Fault("chat answers an empty 200", "chat", "empty_200", statuses(502), "bad_upstream_response"),
    Fault("chat answers gzip", "chat", "gzip", statuses(200)),
    Fault("chat answer cut short", "chat", "truncated", UNAVAILABLE),
    Fault("chat answer with broken chunking", "chat", "bad_chunked", statuses(502, 503)),
    # aiohttp 3.14 does not report a bad chunk that arrives after the head was read, nor the close behind it:
    # the read waits for the silence limit, and the client gets the timeout's clean 504.
    Fault("chat answer with a bad chunk after its head", "chat", "bad_chunk_late", statuses(502, 503, 504)),
    Fault("chat answer with a 70 KB header", "chat", "huge_header", statuses(502)),
    Fault("chat 503 keeps its Retry-After", "chat", "error_503", statuses(503), retry_after="7"),
    Fault("chat 429 keeps its Retry-After", "chat", "error_429", statuses(429), retry_after="3"),
    Fault("chat 405 gets an OpenAI type", "chat", "error_405", statuses(405), error_type="invalid_request_error"),
    Fault("chat 500 in plain text", "chat", "error_500_text", statuses(500, 502)),
    Fault("chat 400 in vLLM's old flat shape", "chat", "error_400_flat", statuses(400)),
    Fault("completions ok", "completions", "ok", statuses(200)),
    Fault("completions reset", "completions", "reset", UNAVAILABLE),
    Fault("completions never answers", "completions", "hang", statuses(504), "upstream_timeout"),
    Fault("completions answers html", "completions", "garbage", statuses(502)),
    Fault("completions answers a json array", "completions", "json_array", statuses(502)),
    Fault("completions answers gzip", "completions", "gzip", statuses(200)),
    Fault("completions 503 keeps its Retry-After", "completions", "error_503", statuses(503), retry_after="7"),
    Fault("detokenize ok", "detokenize", "ok", statuses(200)),
    Fault("detokenize reset", "detokenize", "reset", UNAVAILABLE),
    Fault("detokenize never answers", "detokenize", "hang", statuses(504)),
    Fault("detokenize answers gzip", "detokenize", "gzip", statuses(200)),
    Fault("detokenize 503 keeps its Retry-After", "detokenize", "error_503", statuses(503), retry_after="7"),
    Fault("detokenize 405 gets an OpenAI type", "detokenize", "error_405", statuses(405),
          error_type="invalid_request_error"),
    Fault("detokenize answer cut short", "detokenize", "truncated", UNAVAILABLE),
]


@pytest.mark.parametrize("fault", [pytest.param(f, id=f.id) for f in ANSWERS])
def test_an_upstream_fault_becomes_a_clean_answer(rogue_gw: Target, fault: Fault) -> None:
    r = rogue_gw.client.post(PATHS[fault.route], json=body_for(fault.route, fault.mode))
    err = check_answer(r.status_code, r.content, fault.case())
    if r.status_code == 200:
        data = r.json()  # decoded: a gzip answer must not reach the client still compressed and mislabelled
        assert isinstance(data, dict)
    if fault.retry_after is not None:
        assert r.headers.get("retry-after") == fault.retry_after
    if fault.error_type is not None:
        assert err is not None and err["type"] == fault.error_type
    if err is not None:
        assert UPSTREAM_KEY not in err["message"]
    rogue_gw.still_well()


@dataclass(frozen=True)
class StreamFault:
    id: str
    route: str
    mode: str
    status: frozenset[int]
    # Whether the relayed stream must end with an error event (then [DONE]).
    ends_in_error: bool = False
    retry_after: str | None = None


STREAMS = [
    StreamFault("stream ok", "chat", "ok", statuses(200)),
    StreamFault("completion stream ok", "completions", "ok", statuses(200)),
    StreamFault("stream broken mid-event", "chat", "broken_stream", statuses(200), ends_in_error=True),
    StreamFault("completion stream broken mid-event", "completions", "broken_stream", statuses(200),
                ends_in_error=True),
    StreamFault("stream events split after data:", "chat", "split_stream", statuses(200)),
    StreamFault("completion stream events split", "completions", "split_stream", statuses(200)),
    StreamFault("stream framed with CRLF", "chat", "crlf_stream", statuses(200)),
    StreamFault("stream without [DONE]", "chat", "stream_no_done", statuses(200)),
    StreamFault("stream silent past the read timeout", "chat", "slow_stream", statuses(200, 504),
                ends_in_error=True),
    StreamFault("stream gzip-encoded", "chat", "gzip", statuses(200)),
    StreamFault("stream answered as json", "chat", "stream_json", statuses(502)),
    StreamFault("stream reset before answering", "chat", "reset", UNAVAILABLE),
    StreamFault("stream never answers", "chat", "hang", statuses(504)),
    StreamFault("stream 503 keeps its Retry-After", "chat", "error_503", statuses(503), retry_after="7"),
]


@pytest.mark.parametrize("fault", [pytest.param(f, id=f.id) for f in STREAMS])
async def test_a_stream_is_relayed_in_whole_events_whatever_the_upstream_does(
    rogue_gw: Target, fault: StreamFault
) -> None:
    body = json.dumps(body_for(fault.route, fault.mode, stream=True)).encode()
    headers = {"content-type": "application/json", "connection": "close"}
    r = await raw_exchange(rogue_gw.url, request_bytes("POST", PATHS[fault.route], headers, body))
    assert r is not None, f"{fault.id}: no answer"
    check_answer(r.status, r.body, Case(fault.id, status=fault.status))
    if fault.retry_after is not None:
        assert r.headers.get("retry-after") == fault.retry_after
    if r.status != 200:
        rogue_gw.still_well()
        return
    assert r.headers["content-type"].startswith("text/event-stream")
    assert "content-encoding" not in r.headers
    # Each write of the gateway holds whole events: a naive client reading one write at a time never sees half.
    for chunk in r.chunks:
        normalised = chunk.replace(b"\r\n", b"\n")
        assert normalised.endswith(b"\n\n"), f"{fault.id}: a write ends inside an event: {chunk[-80:]!r}"
    events = [event_data(e) for e in sse_events(r.body)]
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    if fault.ends_in_error:
        assert errors, f"{fault.id}: the stream ended without an error event: {events}"
        error_of(json.dumps(errors[-1]).encode())
        assert events[-1] == "[DONE]"
        assert events.index(errors[-1]) == len(events) - 2
    else:
        assert not errors, errors
        assert any(isinstance(e, dict) and e.get("choices") for e in events)
    rogue_gw.still_well()


def test_the_client_key_and_cookies_never_reach_the_upstream(rogue_gw: Target, rogue: Rogue) -> None:
    sent = {"x-api-key": "sk-client-own", "cookie": "session=abc", "authorization": "Bearer sk-client-own"}
    for i, (path, route) in enumerate([("/detokenize", "detokenize"), ("/v1/chat/completions", "chat")]):
        rid = f"forwarding-{i}"
        r = rogue_gw.client.post(path, json=body_for(route, "ok"), headers={**sent, "x-request-id": rid})
        assert r.status_code == 200, r.text
        (seen,) = rogue.requests_with_id(rid)
        assert "x-api-key" not in seen.headers and "cookie" not in seen.headers, seen.headers
        assert seen.headers["authorization"] == f"Bearer {UPSTREAM_KEY}"
    rogue_gw.still_well()


EXACT = [
    pytest.param("chat", {"seed": 2**64 + 1}, id="chat seed beyond 64 bits"),
    pytest.param("chat", {"logit_bias": {"5": -(2**70)}, "top_p": 0.1}, id="chat big negative and a decimal"),
    pytest.param("chat", {"user": "caf\u00e9 \u2603 \U0001f600 \\ \" \u0000"}, id="chat unicode and escapes"),
    pytest.param("chat", {"metadata": {"a": [[[[[{"b": [1, 2.5e-300, None, True]}]]]]]}},
                 id="chat nested pass-through"),
    pytest.param("completions", {"seed": 2**64 + 1, "logprobs": 0}, id="completions seed beyond 64 bits"),
    pytest.param("completions", {"prompt": [1, 2, 3], "seed": 2**100}, id="completions token ids and a 2^100 seed"),
]


@pytest.mark.parametrize(("route", "extra"), EXACT)
def test_json_reaches_the_upstream_exactly(rogue_gw: Target, rogue: Rogue, route: str, extra: dict[str, Any]
                                           ) -> None:
    body = body_for(route, "ok", **extra)
    rid = "exact-" + route + "-" + str(abs(hash(json.dumps(extra))) % 10**8)
    r = rogue_gw.client.post(PATHS[route], content=json.dumps(body), headers={"x-request-id": rid,
                                                                             "content-type": "application/json"})
    assert r.status_code == 200, r.text
    (seen,) = rogue.requests_with_id(rid)
    received = json.loads(seen.body)
    for key in ("max_tokens", "max_completion_tokens"):
        received.pop(key, None)
        body.pop(key, None)
    assert received == body
    if "prompt" in extra:
        assert received["prompt"] == extra["prompt"]
    rogue_gw.still_well()


# -- the upstream's connection misbehaving: every case answered at once, nothing sent twice, the next unharmed --
@pytest.mark.parametrize("mode", list(ENDLESS))
def test_an_endless_answer_head_is_a_prompt_502_and_its_connection_is_dropped(
    rogue_gw: Target, rogue: Rogue, mode: str
) -> None:
    rid = f"endless-{mode}"
    t0 = time.monotonic()
    r = rogue_gw.client.post(PATHS["chat"], json=body_for("chat", mode), headers={"x-request-id": rid})
    took = time.monotonic() - t0
    check_answer(r.status_code, r.content, Case(mode, status=statuses(502), code="bad_upstream_response"))
    assert took < 3.0, f"{mode}: answered after {took:.1f} s"
    deadline = time.monotonic() + 10
    while rid not in rogue.written:  # the upstream stops writing once the gateway has dropped the connection
        assert time.monotonic() < deadline, "the upstream still writes its endless head"
        time.sleep(0.05)
    assert rogue.written[rid] < ENDLESS_BYTES // 3, rogue.written[rid]
    rogue_gw.still_well()


def completion_events(r: RawResponse | None) -> list[Any]:
    assert r is not None and r.status == 200, r
    events = [event_data(e) for e in sse_events(r.body)]
    assert not [e for e in events if isinstance(e, dict) and "error" in e], events
    return events


@pytest.mark.parametrize("mode", ["surplus", "unasked"], ids=["7 bytes past its length", "an unasked answer behind"])
async def test_an_answer_with_bytes_behind_it_is_served_and_the_next_requests_are_unharmed(
    rogue_gw: Target, mode: str
) -> None:
    headers = {"content-type": "application/json", "connection": "close"}
    # Several at once, so that several connections carry bytes behind an answer (the engine view's scrapes take
    # pooled connections too).
    first = request_bytes("POST", PATHS["chat"], headers, json.dumps(body_for("chat", mode)).encode())
    for r in await asyncio.gather(*(raw_exchange(rogue_gw.url, first) for _ in range(4))):
        assert r is not None and r.status == 200, r
        assert json.loads(r.body)["choices"][0]["message"]["content"] == "fine", r.body
    stream = request_bytes("POST", PATHS["chat"], headers, json.dumps(body_for("chat", "long_stream", stream=True))
                           .encode())
    plain = request_bytes("POST", PATHS["completions"], headers, json.dumps(body_for("completions", "ok")).encode())
    for _ in range(3):  # at once: two requests that must never share the connection the answer came on
        streamed, answered = await asyncio.gather(raw_exchange(rogue_gw.url, stream), raw_exchange(rogue_gw.url, plain))
        events = completion_events(streamed)
        assert len(events) == 21 and events[-1] == "[DONE]", events
        assert answered is not None and answered.status == 200, answered
        assert json.loads(answered.body)["choices"][0]["text"] == "fine"
    rogue_gw.still_well()


@pytest.mark.parametrize(("route", "mode", "stream"), [
    ("chat", "close", False), ("chat", "reset", False), ("completions", "close", False), ("chat", "close", True),
], ids=["chat closed", "chat reset", "completions closed", "chat stream closed"])  # fmt: skip
def test_a_post_the_upstream_read_and_closed_on_is_a_503_and_never_sent_again(
    rogue_gw: Target, rogue: Rogue, route: str, mode: str, stream: bool
) -> None:
    for i in range(2):  # on a new connection, then (the gateway holding idle ones) on a pooled one
        rid = f"once-{route}-{mode}-{stream}-{i}"
        r = rogue_gw.client.post(PATHS[route], json=body_for(route, mode, stream=stream),
                                 headers={"x-request-id": rid})
        check_answer(r.status_code, r.content, Case(rid, status=statuses(503)))
        assert float(r.headers["retry-after"]) > 0
        assert len(rogue.requests_with_id(rid)) == 1, f"{rid}: the upstream read it more than once"
    rogue_gw.still_well()


def test_an_upstream_that_closes_each_new_connection_at_once_is_a_503_with_retry_after(
    rogue_gw: Target, rogue: Rogue
) -> None:
    with rogue.closing_new_connections():
        for i in range(3):
            r = rogue_gw.client.post(PATHS["chat"], json=body_for("chat", "ok"))
            check_answer(r.status_code, r.content, Case(f"closed at once {i}", status=statuses(503)))
            assert float(r.headers["retry-after"]) > 0
    deadline = time.monotonic() + 15
    while rogue_gw.client.post(PATHS["chat"], json=body_for("chat", "ok")).status_code != 200:
        assert time.monotonic() < deadline, "the gateway did not come back once the upstream took connections again"
        time.sleep(0.1)
    rogue_gw.still_well()
