"""One connection's state machine, read by read, on a transport that records what was done to it: the moves it
makes, when it goes back to the pool (once, after a whole answer with nothing behind it) and when it closes."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from gateway.engine.connection import Connection, State
from gateway.engine.pool import Pool
from gateway.engine.wire import MAX_HEAD_BYTES, PAUSE_AT, Exchange
from gateway.errors import BadUpstreamResponse, UpstreamLost

from .scripted_engine import answer, body_of


@dataclass
class Transport:
    written: list[bytes] = field(default_factory=list)
    reading: bool = True
    aborted: bool = False
    buffered: int = 0

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.aborted

    def abort(self) -> None:
        self.aborted = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default


class CountingPool(Pool):
    def __init__(self) -> None:
        super().__init__("127.0.0.1", 1, None, 4, 10.0, lambda: "http://engine")
        self.released: list[Connection] = []

    def release(self, conn: Connection) -> None:
        self.released.append(conn)
        super().release(conn)


def busy_connection() -> tuple[CountingPool, Connection, Transport, Exchange]:
    pool = CountingPool()
    conn = Connection(pool)
    transport = Transport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    pool.conns.add(conn)
    exchange = Exchange(pool.loop.time() + 10, 10)
    conn.send(exchange, b"POST / HTTP/1.1\r\n\r\n")
    return pool, conn, transport, exchange


async def body(exchange: Exchange) -> bytes:
    await exchange.head
    chunks = []
    while (chunk := await exchange.sink.next()) is not None:  # type: ignore[attr-defined]
        chunks.append(chunk)
    return b"".join(chunks)


def split(data: bytes, every: int) -> list[bytes]:
    return [data[i : i + every] for i in range(0, len(data), every)]


class RecordingSink:
    """A sink that records what the connection calls on it, in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def body(self, data: bytes) -> None:
        self.calls.append("body")

    def flush(self) -> None:
        self.calls.append("flush")

    def end(self, error: object) -> None:
        self.calls.append("end")


STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
EVENT = b"data: x\n\n"
CHUNK = b"%x\r\n%s\r\n" % (len(EVENT), EVENT)


# (case, the reads after the head, what the sink is told)
FLUSHES = [
    ("three chunks in one read: one flush", [CHUNK * 3], ["body", "body", "body", "flush"]),
    ("a chunk a read: a flush each", [CHUNK, CHUNK], ["body", "flush", "body", "flush"]),
    ("a chunk split over two reads", [CHUNK[:5], CHUNK[5:]], ["body", "flush", "body", "flush"]),
    ("the last chunk and the end in one read: the end hands it on", [CHUNK + b"0\r\n\r\n"], ["body", "end"]),
]


@pytest.mark.parametrize(("reads", "calls"), [pytest.param(*f[1:], id=f[0]) for f in FLUSHES])
async def test_a_sink_is_flushed_once_a_read_after_the_pieces_that_read_brought(
    reads: list[bytes], calls: list[str]
) -> None:
    _, conn, _, exchange = busy_connection()
    conn.data_received(STREAM_HEAD)
    await exchange.head
    sink = RecordingSink()
    exchange.sink = sink
    for data in reads:
        conn.data_received(data)
    assert sink.calls == calls


# (case, the reads, the state after them, released to the pool)
READS = [
    ("a whole answer in one read", [answer("a")], State.IDLE, 1),
    ("a whole answer a byte at a time", split(answer("a"), 1), State.IDLE, 1),
    ("a chunked answer in pieces of 3", split(answer("a", chunked=True), 3), State.IDLE, 1),
    ("a 1xx then the answer", [answer("a", informational=True)], State.IDLE, 1),
    ("surplus in the answer's read", [answer("a") + b"surplus"], State.CLOSED, 0),
    ("surplus in the next read", [answer("a"), b"surplus"], State.CLOSED, 1),
    ("a second answer in the same read", [answer("a") + answer("b")], State.CLOSED, 0),
    ("a second answer in the next read", [answer("a"), answer("b")], State.CLOSED, 1),
    ("an answer that asks to close", [answer("a").replace(b"OK\r\n", b"OK\r\nconnection: close\r\n")],
     State.CLOSED, 0),
    ("an HTTP/1.0 answer", [answer("a").replace(b"HTTP/1.1", b"HTTP/1.0")], State.CLOSED, 0),
]


@pytest.mark.parametrize(("reads", "state", "released"), [pytest.param(*r[1:], id=r[0]) for r in READS])
async def test_a_connection_goes_back_to_the_pool_once_and_only_after_a_whole_answer_with_nothing_behind(
    reads: list[bytes], state: State, released: int
) -> None:
    pool, conn, transport, exchange = busy_connection()
    for data in reads:
        conn.data_received(data)
    assert await body(exchange) == body_of("a")  # the answer itself is delivered whatever follows it
    assert conn.state is state and len(pool.released) == released
    assert transport.aborted == (state is State.CLOSED)
    assert (conn in pool.idle) == (state is State.IDLE) and pool.idle.count(conn) <= 1


@pytest.mark.parametrize(("reads", "error"), [
    pytest.param([b"HTTP/1.1 200 OK\r\nx: " + b"v" * MAX_HEAD_BYTES], "head is longer", id="a head past its cap"),
    pytest.param([b"HTTP/1.1 200 " + b"r" * 40_000, b"r" * 40_000], "head is longer", id="a long reason phrase"),
    pytest.param([b"SSH-2.0-OpenSSH_9.6\r\n"], "invalid HTTP response", id="not HTTP"),
    pytest.param([b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\n"],
                 "invalid HTTP response", id="two framings"),
    pytest.param([b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\nconnection: upgrade\r\n\r\n"],
                 "invalid HTTP response", id="an upgrade nobody asked for"),
])  # fmt: skip
async def test_a_bad_answer_fails_its_exchange_and_closes_the_connection(reads: list[bytes], error: str) -> None:
    pool, conn, transport, exchange = busy_connection()
    for data in reads:
        conn.data_received(data)
    with pytest.raises(BadUpstreamResponse, match=error):
        await exchange.head
    assert conn.state is State.CLOSED and transport.aborted and not pool.released and conn not in pool.conns


async def test_a_head_that_ends_within_its_cap_is_read_with_the_body_that_follows_in_the_same_read() -> None:
    data = b"HTTP/1.1 200 OK\r\nx: " + b"v" * (MAX_HEAD_BYTES - 100) + b"\r\ncontent-length: 3000\r\n\r\n" + b"b" * 3000
    pool, conn, _, exchange = busy_connection()
    conn.data_received(data)
    assert await body(exchange) == b"b" * 3000
    assert conn.state is State.IDLE and pool.released == [conn]


async def test_bytes_while_idle_close_the_connection_and_take_it_out_of_the_pool() -> None:
    pool, conn, _, _ = busy_connection()
    conn.data_received(answer("a"))
    assert conn in pool.idle
    conn.data_received(b"HTTP/1.1 200 OK\r\n")
    assert conn.state is State.CLOSED and conn not in pool.idle and conn not in pool.conns


async def test_a_connection_paused_for_a_slow_reader_reads_again_once_back_in_the_pool() -> None:
    _, conn, transport, _ = busy_connection()
    conn.data_received(answer("a", body=b"x" * (PAUSE_AT + 1)))  # the reader has not read yet: paused
    assert conn.state is State.IDLE and transport.reading and not conn.paused


@pytest.mark.parametrize(("unsent", "head", "may_have_read"), [
    (False, False, True), (True, False, False), (True, True, True),
], ids=["all of it sent", "part of it unsent", "answered in part"])
async def test_a_lost_connection_says_whether_the_engine_may_have_read_the_request(
    unsent: bool, head: bool, may_have_read: bool
) -> None:
    _, conn, _, exchange = busy_connection()
    if unsent:
        conn.pause_writing()
    if head:
        conn.data_received(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nabc")
        await exchange.head
    conn.connection_lost(ConnectionResetError())
    with pytest.raises(UpstreamLost) as raised:
        await body(exchange)
    assert raised.value.may_have_read == may_have_read and raised.value.retry_after
    assert conn.state is State.CLOSED


async def test_a_state_move_outside_the_machine_is_refused() -> None:
    _, conn, _, exchange = busy_connection()
    with pytest.raises(AssertionError, match="from busy to busy"):
        conn.send(exchange, b"again")
    conn.close()
    with pytest.raises(AssertionError, match="from closed to busy"):
        conn.send(Exchange(0, 0), b"again")


async def test_a_connection_closed_while_connecting_is_never_usable() -> None:
    conn = Connection(CountingPool())
    conn.connection_lost(ConnectionResetError())
    assert conn.state is State.CLOSED and not conn.usable()
