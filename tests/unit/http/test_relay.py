"""Streams are relayed one whole server-sent event per write, whatever the upstream's read boundaries, and an
error inside a stream is written only between events."""

from __future__ import annotations

import asyncio
import gc
import gzip
import time
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.config import Settings
from gateway.engine.engine import Engine
from gateway.engine.sse import PartialEvent, SSEFramer
from gateway.errors import BadUpstreamResponse, UpstreamUnavailable
from gateway.guard import exchange
from gateway.guard.context import Booking, RequestContext
from gateway.guard.exchange import Reply
from gateway.guard.parts import Parts
from gateway.http.relay import StreamAnswer
from gateway.http.server import GuardProtocol
from gateway.http.stream_out import HeldBytes
from gateway.metrics import Metrics
from gateway.observe.tracing import OFF
from testing.bad_upstream import BadUpstream, RawReply, chunked, is_one_whole_event, raw_request, run_bad_upstream
from testing.gateway_thread import GatewayServer, run_gateway
from tests.support.fake_stream import FakeReservation, FakeStream, FakeUpstream

# A chat stream as vLLM writes it: multi-byte UTF-8 inside, one event per token, then [DONE].
EVENTS = [
    b'data: {"choices":[{"index":0,"delta":{"content":"h\xc3\xa9llo"}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":" \xe2\x82\xac5"}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
    b"data: [DONE]\n\n",
]
STREAM = b"".join(EVENTS)


def styled(events: list[bytes], end: bytes) -> list[bytes]:
    """The same events with another line end (the SSE spec allows CRLF, LF and CR)."""
    return [e.replace(b"\n", end) for e in events]


STYLES = {
    "LF": EVENTS,
    "CRLF": styled(EVENTS, b"\r\n"),
    "CR": styled(EVENTS, b"\r"),
    "named events and comments": [b": ping\n\n", b"event: message\ndata: {}\nid: 7\n\n", *EVENTS],
    "multi-line data": [b"data: one\ndata: two\n\n", b"data: three\r\ndata: four\r\n\r\n", b"data: [DONE]\n\n"],
}


def frame(pieces: list[bytes], limit: int = 1 << 20) -> list[bytes]:
    framer = SSEFramer(limit)
    events = [e for piece in pieces for e in framer.feed(piece)]
    return events + framer.close()


def splits(data: bytes) -> Iterator[tuple[str, list[bytes]]]:
    yield "whole", [data]
    yield "byte by byte", [data[i : i + 1] for i in range(len(data))]
    for i in range(1, len(data)):
        yield f"split at {i}", [data[:i], data[i:]]


class TestFraming:
    @pytest.mark.parametrize("style", STYLES, ids=list(STYLES))
    def test_every_read_boundary_gives_the_same_whole_events(self, style: str) -> None:
        events = STYLES[style]
        for how, pieces in splits(b"".join(events)):
            assert frame(pieces) == events, how

    def test_a_read_that_is_exactly_one_event_is_passed_on_without_a_copy(self) -> None:
        framer = SSEFramer(1 << 20)
        assert framer.feed(EVENTS[0])[0] is EVENTS[0]

    def test_several_events_in_one_read_become_one_write_each(self) -> None:
        assert SSEFramer(1 << 20).feed(STREAM) == EVENTS

    def test_extra_blank_lines_between_events_are_dropped(self) -> None:
        assert frame([b"\n\n" + EVENTS[0] + b"\n\n\r\n" + EVENTS[1]]) == EVENTS[:2]

    def test_a_last_event_with_whole_lines_but_no_blank_line_is_completed(self) -> None:
        assert frame([EVENTS[0], b"data: [DONE]\n"]) == [EVENTS[0], b"data: [DONE]\n\n"]
        assert frame([b"data: x\r\n"]) == [b"data: x\r\n\n"]

    @pytest.mark.parametrize("tail", [b"data: {\"choi", b"data:", b"d"], ids=["mid-json", "after data:", "one byte"])
    def test_a_stream_that_ends_mid_line_raises_after_the_whole_events(self, tail: bytes) -> None:
        framer = SSEFramer(1 << 20)
        assert framer.feed(EVENTS[0] + tail) == [EVENTS[0]]
        with pytest.raises(PartialEvent):
            framer.close()

    def test_an_event_longer_than_the_limit_is_refused_and_not_held(self) -> None:
        framer = SSEFramer(1024)
        assert framer.feed(EVENTS[0]) == [EVENTS[0]]
        framer.feed(b"data: " + b"x" * 1000)
        with pytest.raises(BadUpstreamResponse, match="larger than the limit of 1024 bytes"):
            framer.feed(b"x" * 100)

    def test_an_event_just_under_the_limit_arriving_in_small_reads_passes(self) -> None:
        event = b"data: " + b"x" * 4000 + b"\n\n"
        assert frame([event[i : i + 7] for i in range(0, len(event), 7)], limit=4096) == [event]


# -- the relay, without a network -----------------------------------------------------------------
def fake_parts(stream: FakeStream) -> Parts:
    return Parts(Settings(), Metrics(), Engine(FakeUpstream(stream), None, None), None)  # type: ignore[arg-type]


def stream_answer(parts: Parts, reservation: FakeReservation) -> AsyncGenerator[Reply, None]:
    ctx = RequestContext("r1", "chat", "/v1/chat/completions", {})
    booking = Booking(prompt_tokens=1, max_tokens=1, n=1, stream=True)
    return exchange.exchange_with_engine(parts, ctx, b"{}", booking, reservation)  # type: ignore[arg-type]


async def written(response: StreamAnswer) -> list[bytes]:
    """What a client receives, write by write."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()  # the client stays
        return {}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
    return [m["body"] for m in sent if m["type"] == "http.response.body" and m.get("body")]


async def relay_all(stream: FakeStream) -> tuple[list[bytes], FakeReservation, Parts]:
    reservation = FakeReservation()
    parts = fake_parts(stream)
    answer = stream_answer(parts, reservation)
    head = await anext(answer)
    assert isinstance(head, Reply) and head.stream is not None
    response = StreamAnswer(answer, head.stream, head.headers, HeldBytes(1 << 30), OFF)
    return await written(response), reservation, parts


def error_of(write: bytes) -> dict[str, Any]:
    assert write.startswith(b"data: ") and write.endswith(b"\n\n")
    error: dict[str, Any] = orjson.loads(write[6:])["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


class TestStreamRelay:
    async def test_progress_counts_one_token_per_data_event_whatever_the_reads(self) -> None:
        writes, reservation, parts = await relay_all(FakeStream([STREAM[:7], STREAM[7:90], STREAM[90:]]))
        assert writes == EVENTS
        assert reservation.observed[-1] == 3  # three data events before [DONE]
        assert reservation.released == [True] and parts.metrics.in_flight._value.get() == 0

    async def test_a_break_mid_event_drops_the_partial_event_and_writes_the_error_on_its_own(self) -> None:
        cut = UpstreamUnavailable("The upstream dropped the stream: reset")
        writes, reservation, _ = await relay_all(FakeStream([EVENTS[0], EVENTS[1][:20]], fail=cut))
        assert writes[0] == EVENTS[0] and writes[2] == b"data: [DONE]\n\n"
        assert error_of(writes[1])["code"] == "upstream_unavailable"
        assert reservation.released == [False]

    async def test_an_end_mid_event_is_an_error_event_after_the_whole_ones(self) -> None:
        writes, reservation, _ = await relay_all(FakeStream([EVENTS[0] + EVENTS[1][:9]]))
        assert writes[0] == EVENTS[0] and error_of(writes[1])["code"] == "bad_upstream_response"
        assert writes[2:] == [b"data: [DONE]\n\n"] and reservation.released == [False]

    async def test_an_oversized_event_ends_the_stream_with_an_error_event(self) -> None:
        huge = b"data: " + b"x" * (Settings().max_stream_event_bytes + 10)
        writes, reservation, _ = await relay_all(FakeStream([EVENTS[0], huge]))
        assert writes[0] == EVENTS[0] and "larger than the limit" in error_of(writes[1])["message"]
        assert reservation.released == [False]

    async def test_a_gzip_stream_is_decoded_and_framed(self) -> None:
        packed = gzip.compress(STREAM)
        writes, reservation, _ = await relay_all(
            FakeStream([packed[i : i + 5] for i in range(0, len(packed), 5)], encoding="gzip")
        )
        assert writes == EVENTS and reservation.released == [True]

    async def test_a_relayed_stream_is_freed_by_reference_counting_alone(self) -> None:
        """Its sink's ``on_cut`` holds the stream's ``end``, and the stream held its sink until it was freed: every
        stream was a reference cycle, with its reservation, exchange and the connection's request-response cycle,
        that only the cyclic collector freed (~35 objects a stream; under 256 streams a young collection then
        took ~10 ms of the loop, every few thousand streams)."""
        def streams() -> int:  # type(), not isinstance(): see test_client's freed exchange
            return sum(1 for o in gc.get_objects() if type(o) is exchange.EngineStream)

        gc.collect()
        gc.disable()
        try:
            before = streams()
            reservation = FakeReservation()
            answer = stream_answer(fake_parts(FakeStream([STREAM])), reservation)
            head = await anext(answer)
            assert head.stream is not None
            response = StreamAnswer(answer, head.stream, head.headers, HeldBytes(1 << 30), OFF)
            del head, answer
            assert await written(response) == EVENTS and reservation.released == [True]
            del response
            assert streams() == before, "the stream waits for the cyclic collector"
        finally:
            gc.enable()

    async def test_a_stream_answered_with_another_content_type_is_502_and_frees_everything_once(self) -> None:
        stream = FakeStream([b"{}"], content_type="application/json")
        parts, reservation = fake_parts(stream), FakeReservation()
        with pytest.raises(BadUpstreamResponse):
            await anext(stream_answer(parts, reservation))
        assert stream.closed == 1 and parts.metrics.in_flight._value.get() == 0


# -- through the gateway, against a misbehaving upstream ---------------------------------------------
@pytest.fixture(scope="module")
def upstream() -> Iterator[BadUpstream]:
    with run_bad_upstream() as server:
        yield server


@pytest.fixture(scope="module")
def gateway(upstream: BadUpstream, tokenizer_dir: Path) -> Iterator[GatewayServer]:
    settings = Settings(tokenizer=str(tokenizer_dir), scrape_interval=0.05, queue_timeout=5.0, read_timeout=5.0)
    with run_gateway(settings, upstream=upstream.url) as gw:
        yield gw


CHAT = orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                     "stream": True})


def stream_through(gw: GatewayServer, upstream: BadUpstream, pieces: list[bytes], **kw: Any) -> RawReply:
    upstream.answer = chunked(pieces, **kw)
    reply = raw_request(gw.url, "/v1/chat/completions", CHAT)
    gw.wait_ledger_empty()
    return reply


MID_UTF8 = STREAM.index(b"\xc3") + 1
SPLITS = {
    "at every byte": [STREAM[i : i + 1] for i in range(len(STREAM))],
    "right after data:": [p for e in EVENTS for p in (e[:5], e[5:])],
    "mid UTF-8 character": [STREAM[:MID_UTF8], STREAM[MID_UTF8:]],
    "between the two newlines": [p for e in EVENTS for p in (e[:-1], e[-1:])],
    "all events in one read": [STREAM],
    "CRLF events in 7-byte reads": [b"".join(STYLES["CRLF"])[i : i + 7] for i in range(0, len(STREAM) + 20, 7)],
}


@pytest.mark.parametrize("how", SPLITS, ids=list(SPLITS))
def test_the_client_receives_one_whole_event_per_write(gateway: GatewayServer, upstream: BadUpstream, how: str) -> None:
    reply = stream_through(gateway, upstream, SPLITS[how], pause=0.0005)
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/event-stream")
    assert all(is_one_whole_event(w) for w in reply.chunks), reply.chunks
    expected = STYLES["CRLF"] if how.startswith("CRLF") else EVENTS
    assert reply.chunks == expected


BREAKS = {
    "cut mid-event (connection closed)": ([EVENTS[0], EVENTS[1][:25]], "cut", "upstream_unavailable"),
    "reset mid-event": ([EVENTS[0], EVENTS[1][:25]], "reset", "upstream_unavailable"),
    "ended cleanly mid-event": ([EVENTS[0], EVENTS[1][:25]], "clean", "bad_upstream_response"),
    "cut right after data:": ([EVENTS[0], b"data:"], "cut", "upstream_unavailable"),
}


@pytest.mark.parametrize("how", BREAKS, ids=list(BREAKS))
def test_a_broken_stream_ends_with_an_error_event_after_the_last_whole_event(
    gateway: GatewayServer, upstream: BadUpstream, how: str
) -> None:
    pieces, end, code = BREAKS[how]
    reply = stream_through(gateway, upstream, pieces, end=end)
    assert reply.status == 200
    assert all(is_one_whole_event(w) for w in reply.chunks), reply.chunks
    assert reply.chunks[0] == EVENTS[0]
    assert error_of(reply.chunks[1])["code"] == code
    assert reply.chunks[2:] == [b"data: [DONE]\n\n"]


def test_streams_on_connections_closed_after_them_are_freed_by_reference_counting_alone(
    gateway: GatewayServer, upstream: BadUpstream
) -> None:
    """A stream, its exchange and its client's connection each refer to nothing that refers back once they end:
    a stream's relay and its sink, the exchange and its sink, the connection's protocol and its transport were
    reference cycles, every stream and every closed connection, that only the cyclic collector freed (under 256
    streams a young collection took ~10 ms of the loop)."""
    def waiting() -> int:
        return sum(1 for o in gc.get_objects() if type(o) in (GuardProtocol, exchange.EngineStream, StreamAnswer))

    assert stream_through(gateway, upstream, [STREAM]).status == 200  # every lazy part of the path made
    gc.collect()
    gc.disable()
    try:
        before = waiting()
        for _ in range(5):  # each on a connection of its own, closed after its answer
            assert stream_through(gateway, upstream, [STREAM]).status == 200
        give_up = time.monotonic() + 5
        while waiting() > before and time.monotonic() < give_up:  # the server's thread sees the closes
            time.sleep(0.01)
        assert waiting() <= before, "a stream or its connection waits for the cyclic collector"
    finally:
        gc.enable()
