"""Readers that stop reading: a large stream (n=8, 3,000 tokens each: ~5 MB, past what the kernel's socket
buffers take on loopback) whose client never reads. The
reservation follows the engine's request, not the client: once the engine's stream has ended its KV blocks are
given back, and a request needing them is admitted while the stalled client still has read nothing. What waits
for the client is bounded (``--max-buffered-bytes``: past it the stream is cut, the engine's request cancelled,
and the client finds an error event and the stream's end when it reads), and a client that accepts no byte for
``--write-timeout`` seconds is disconnected."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from testing.gateway_thread import GatewayServer, run_gateway
from testing.hostile_checks import event_data, host_port, request_bytes, sse_events
from testing.vllm_sim import SimConfig, SimServer, run_sim_server

from .conftest import hostile_settings

CHAT = "/v1/chat/completions"
# The stalled request books 8 x 189 blocks of 16 tokens of the 1,600; the ordinary one 95 more: it fits only
# once the stalled one's blocks are given back.
BIG = {"model": "tiny", "messages": [{"role": "user", "content": "write"}], "max_tokens": 3000, "n": 8}
ORDINARY = {"model": "tiny", "messages": [{"role": "user", "content": "write"}], "max_tokens": 1500}
NUM_BLOCKS = 1600
SLACK = 3.0  # seconds past a limit that a loaded machine may take


@pytest.fixture(scope="module")
def big_sim(tokenizer: Any, tokenizer_dir: Path) -> Iterator[SimServer]:
    config = SimConfig(model="tiny", root=str(tokenizer_dir), tokenizer=tokenizer, max_model_len=4096,
                       num_blocks=NUM_BLOCKS, block_size=16)
    with run_sim_server(config) as server:
        yield server


@dataclass(frozen=True)
class Stalled:
    id: str
    stream: dict[str, Any]  # the request whose answer is never read
    max_buffered_bytes: int
    write_timeout: float
    # What the client finds when it reads at last: the whole answer, or the cut's error event; None: nothing
    # (it was disconnected).
    finds: str | None


STALLED = [
    Stalled("answer within the bound: blocks back when the engine ends", {**BIG, "stream": True}, 8 << 20, 60.0,
            "whole"),
    Stalled("answer past the bound: cut, engine's request cancelled", {**BIG, "stream": True}, 64 << 10, 60.0,
            "client_too_slow"),
    Stalled("few events of 1,000 tokens (stream_interval)", {**BIG, "stream": True, "stream_interval": 1000},
            64 << 10, 60.0, "whole"),
    Stalled("client accepts no byte: disconnected after the write timeout", {**BIG, "stream": True}, 8 << 20, 1.0,
            None),
]


def stalled_client(url: str, body: dict[str, Any]) -> socket.socket:
    """A client with a tiny receive buffer that sends its request and then reads nothing."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(host_port(url))
    sock.sendall(request_bytes("POST", CHAT, {"content-type": "application/json"}, json.dumps(body).encode()))
    return sock


def read_all(sock: socket.socket, timeout: float = 20.0) -> tuple[bytes, bool]:
    """What the server sent, and whether its chunked body ended properly (rather than the connection)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while not data.endswith(b"\r\n0\r\n\r\n"):
            piece = sock.recv(1 << 16)
            if not piece:
                break
            data += piece
    except (ConnectionError, TimeoutError):
        pass
    finally:
        sock.close()
    return data, data.endswith(b"\r\n0\r\n\r\n")


def dechunked(data: bytes) -> bytes:
    _, _, rest = data.partition(b"\r\n\r\n")
    body = b""
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        body, rest = body + rest[:size], rest[size + 2 :]
    return body


def engine_has(sim: SimServer, count: int, within: float) -> None:
    """Wait until the engine has received ``count`` requests in all."""
    deadline = time.monotonic() + within
    while sim.sim.request_count < count:
        assert time.monotonic() < deadline, f"the engine received {sim.sim.request_count} requests, not {count}"
        time.sleep(0.01)


def ledger_at_zero(gw: GatewayServer, within: float) -> None:
    deadline = time.monotonic() + within
    while not gw.ledger_is_empty():
        assert time.monotonic() < deadline, f"the blocks were not given back: {gw.status()}"
        time.sleep(0.05)


def admitted_meanwhile(gw: GatewayServer) -> None:
    """A request that fits only in blocks the stalled one held is answered."""
    r = httpx.post(gw.url + CHAT, json=ORDINARY, timeout=60)
    assert r.status_code == 200, r.text[:300]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in STALLED])
def test_a_reader_that_stops_reading_gives_the_engines_blocks_back(
    big_sim: SimServer, tokenizer_dir: Path, case: Stalled
) -> None:
    settings = hostile_settings(
        tokenizer_dir, upstream=big_sim.url, admission_policy="strict", queue_timeout=10.0, read_timeout=30.0,
        request_timeout=60.0, max_buffered_bytes=case.max_buffered_bytes, write_timeout=case.write_timeout,
    )
    with run_gateway(settings) as gw:
        seen = big_sim.sim.request_count
        sock = stalled_client(gw.url, case.stream)
        try:
            # The ledger is at zero before the stalled request is admitted too: only once the engine has it does
            # zero mean its blocks came back (else the ordinary request goes first, and the client reads it all).
            engine_has(big_sim, seen + 1, within=30.0)
            ledger_at_zero(gw, within=30.0)
            assert big_sim.sim.running == 0  # the engine ended (or cancelled) the stalled request
            admitted_meanwhile(gw)
            if case.write_timeout < 60.0:
                time.sleep(case.write_timeout + SLACK)
            data, ended = read_all(sock)
        finally:
            sock.close()
        ledger_at_zero(gw, within=5.0)
    events = sse_events(dechunked(data))
    if case.finds is None:
        assert not ended or (events and event_data(events[-1]) == "[DONE]" and len(events) < 5), data[-300:]
        if case.write_timeout < 60.0:
            assert not ended, "the stalled client was not disconnected"
        return
    assert ended, f"the stream did not end properly: {data[-300:]!r}"
    assert event_data(events[-1]) == "[DONE]"
    if case.finds == "whole":
        finishes = [c for e in events[:-1] for c in event_data(e)["choices"] if c.get("finish_reason")]
        assert len(finishes) == BIG["n"] and all(c["finish_reason"] == "length" for c in finishes)
    else:
        error = event_data(events[-2])["error"]
        assert error["code"] == case.finds, error
