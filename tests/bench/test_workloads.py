"""The proxy benchmarks' clients: the stream client counts whole streams and their events, notes the first byte,
and calls a stream that stops short a failure; wrk's report is read off its last line."""

from __future__ import annotations

import asyncio
import math

import pytest

from bench.servers.fake_engine import Connection, Engine
from bench.workloads import streams, wrk


async def fake_engine() -> tuple[asyncio.Server, int]:
    eng = Engine("tiny", 4096, 0.001)
    server = await asyncio.get_running_loop().create_server(lambda: Connection(eng), "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def plan(port: int, usage: str = "none", streams_: int = 4, seconds: float = 0.3) -> streams.Plan:
    return streams.Plan("127.0.0.1", port, "/v1/chat/completions", streams_, 5, seconds, usage, 0.002, 0.01,
                        timeout_s=10)


@pytest.mark.parametrize("usage", ["none", "final", "continuous"])
async def test_streams_complete_with_every_token_counted(usage: str) -> None:
    server, port = await fake_engine()
    try:
        got = await streams.run(plan(port, usage))
    finally:
        server.close()
    assert got["failed"] == 0 and got["completed"] >= 4
    assert got["tokens"] == 5 * got["completed"]
    assert got["events"] == streams.expected_events(5, usage) * got["completed"]
    assert 0 < got["ttfb_p50_ms"] <= got["ttfb_p99_ms"] < 1000 and got["wall_s"] > 0 and got["client_cpu_s"] > 0


async def test_the_tokens_of_completed_streams_are_tallied_by_the_request_id_prefix_of_the_answer() -> None:
    # A gateway's process writes a request id prefix of its own in x-request-id: the tally says who relayed what.
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(ln.split(b":")[1]) for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        events = b"".join(b"data: {}\n\n" for _ in range(streams.expected_events(5, "none") - 1)) + streams.DONE
        writer.write(b"HTTP/1.1 200 OK\r\nx-request-id: 0123456789abcdef0001\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(events), events))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        got = await streams.run(plan(server.sockets[0].getsockname()[1], streams_=1, seconds=0.05))
    finally:
        server.close()
    assert got["completed"] >= 1 and got["by_prefix"] == {"0123456789ab": got["tokens"]}


async def test_a_stream_cut_short_is_a_failure_not_tokens() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n8\r\ndata: x\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(cut, "127.0.0.1", 0)
    try:
        got = await streams.run(plan(server.sockets[0].getsockname()[1], streams_=1, seconds=0.05))
    finally:
        server.close()
    assert got["completed"] == 0 and got["tokens"] == 0 and got["failed"] >= 1
    assert math.isnan(got["ttfb_p50_ms"])


def test_a_stream_body_asks_what_the_client_asks_of_usage() -> None:
    assert "stream_options" not in streams.stream_body(10, "none")
    assert streams.stream_body(10, "final")["stream_options"] == {"include_usage": True}
    assert streams.stream_body(10, "continuous", 0.01)["fake_token_delay"] == 0.01
    assert streams.expected_events(10, "none") == 12 and streams.expected_events(10, "final", chat=False) == 12


def test_wrks_report_is_its_json_line() -> None:
    out = "Running 5s test\n  1 threads\n{\"requests\": 500, \"seconds\": 5.0, \"p50_ms\": 0.3, \"p99_ms\": 1.5, " \
          "\"errors\": 2}\n"
    got = wrk.parse(out, cpu_s=0.25)
    assert (got.requests, got.per_second, got.p50_ms, got.errors, got.cpu_s) == (500, 100.0, 0.3, 2, 0.25)


def test_wrks_slowest_answer_is_read_when_its_report_has_it() -> None:
    out = "{\"requests\": 500, \"seconds\": 5.0, \"p50_ms\": 0.3, \"p99_ms\": 1.5, \"max_ms\": 640.5, \"errors\": 0}\n"
    assert wrk.parse(out, cpu_s=0.0).max_ms == 640.5
