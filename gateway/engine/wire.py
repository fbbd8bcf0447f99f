"""HTTP/1.1 to the engine on asyncio's protocols: one connection per exchange, pooled and kept alive.

The gateway's client sits on the hottest path of every request and every streamed token, so it is built from
the event loop's own callbacks and the C parser (httptools, the one uvicorn reads requests with): an answer's
bytes go from ``data_received`` through the parser to the exchange's sink without a task switch, a future or a
timer per read. aiohttp, the client before, cost ~230 us of one core per short request more than this (its
request and response objects, a timer rescheduled on every read, a task wake per chunk), measured with a fast
fake engine: 326 against 95 us of the proxy's CPU per request at 64 concurrent (docs/overhead.md).

Silence and total time are not timed per read: each exchange notes when its connection last read, and the pool's
sweeper (``Pool.sweep``, run by ``engine/client.py`` a few times a second) fails exchanges past their limits and
closes connections idle past the keep-alive. Errors are ``GatewayError``s, raised here and in ``client.py`` only.
"""

from __future__ import annotations

import asyncio
import collections
import re
import ssl
from collections.abc import Callable
from typing import Protocol

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.errors import BadUpstreamResponse, GatewayError, UpstreamUnavailable

# Past this an answer's head is refused: vLLM's are ~200 bytes; a 70 KB header is an upstream gone wrong.
MAX_HEAD_BYTES = 64 * 1024
# A reader (``BufferSink``) that lets this many bytes wait pauses the connection's reads until it catches up.
PAUSE_AT = 1024 * 1024
UNREACHABLE_RETRY_AFTER = 5.0
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


class Sink(Protocol):
    """Where an exchange's body goes, as it arrives."""

    def body(self, data: bytes) -> None: ...

    def end(self, error: GatewayError | None) -> None: ...


class BufferSink:
    """Holds the body for a reader that awaits it (``next``), pausing the connection while it lags."""

    __slots__ = ("_chunks", "_ended", "_error", "_size", "_waiter", "exchange")

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self._chunks: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._ended = False
        self._error: GatewayError | None = None
        self._waiter: asyncio.Future[None] | None = None

    def body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > PAUSE_AT:
            self.exchange.pause()
        self._wake()

    def end(self, error: GatewayError | None) -> None:
        self._ended, self._error = True, error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next(self) -> bytes | None:
        """The body's next bytes; None at its end; its break raised."""
        while not self._chunks:
            if self._ended:
                if self._error is not None:
                    raise self._error
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = self._chunks.popleft()
        self._size -= len(data)
        if self._size <= PAUSE_AT // 2:
            self.exchange.resume()
        return data


class Exchange:
    """One request and its answer on one connection. ``head`` resolves with the answer's status and headers;
    the body then flows into ``sink`` (a ``BufferSink`` until a reader attaches another)."""

    __slots__ = (
        "conn", "deadline", "done", "error", "got_bytes", "head", "headers", "limit", "read_at", "silence",
        "sink", "status",
    )

    def __init__(self, deadline: float, silence: float) -> None:
        self.deadline = deadline  # loop time by which the whole exchange must be over
        self.limit = 0.0  # the seconds that deadline allowed, for the timeout's message
        self.silence = silence  # seconds the engine may stay silent
        self.read_at = 0.0
        self.conn: Connection | None = None
        self.head: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.status = 0
        self.headers: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())
        self.sink: Sink = BufferSink(self)
        self.got_bytes = False  # any byte of the answer: a request that got one is never sent again
        self.done = False
        self.error: GatewayError | None = None

    def attach(self, sink: Sink) -> None:
        """Send the body to ``sink`` from now on, after what the buffer already holds."""
        held = self.sink
        self.sink = sink
        if isinstance(held, BufferSink):
            while held._chunks:
                sink.body(held._chunks.popleft())
            held._size = 0
            if held._ended:
                sink.end(held._error)
        self.resume()

    def fail(self, error: GatewayError) -> None:
        """End the exchange with ``error`` (the head's waiter, or the body's sink, gets it) and drop its
        connection, which aborts the engine's request."""
        if self.done:
            return
        self.done, self.error = True, error
        if not self.head.done():
            self.head.set_exception(error)
        else:
            self.sink.end(error)
        conn = self.conn
        if conn is not None:
            conn.drop()

    def close(self) -> None:
        """The reader is done: a whole answer leaves its connection pooled; anything else drops it."""
        if not self.done:
            self.done = True
            if not self.head.done():
                self.head.cancel()
            if self.conn is not None:
                self.conn.drop()

    def pause(self) -> None:
        if self.conn is not None:
            self.conn.pause()

    def resume(self) -> None:
        if self.conn is not None:
            self.conn.resume()


class Connection(asyncio.Protocol):
    """One kept-alive connection to the engine; the parser's callbacks feed the exchange in progress."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self._time = pool.loop.time
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        # A header value with a control character (``Retry-After: soon\x7f``) fails the whole answer in the strict
        # parser; it is read, and the field dropped (``on_header``), as a lenient client would.
        self.parser.set_dangerous_leniencies(lenient_headers=True)
        self.exchange: Exchange | None = None
        self.idle_since = 0.0
        self.closed = False
        self.paused = False
        self._head_bytes = 0
        self._raw_headers: list[tuple[str, str]] = []
        self._framed = True  # the answer has a length or chunks (else it ends with the connection)
        self._informational = False

    # -- asyncio's callbacks ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (uvloop's is no subclass)

    def data_received(self, data: bytes) -> None:
        exchange = self.exchange
        if exchange is None:  # bytes nobody asked for: the connection is not safe to reuse
            self.drop()
            return
        exchange.got_bytes = True
        exchange.read_at = self._time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            exchange.fail(BadUpstreamResponse(f"The upstream sent an invalid HTTP response: {exc}."))
        except GatewayError as exc:  # raised by a callback below
            exchange.fail(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        exchange, self.exchange = self.exchange, None
        if exchange is None or exchange.done:
            return
        if exchange.head.done() and not self._framed:
            exchange.done = True  # an answer without a length ends with its connection
            exchange.sink.end(None)
            return
        if not exchange.head.done():
            exchange.fail(UpstreamUnavailable(
                "The upstream closed the connection before answering.", retry_after=UNREACHABLE_RETRY_AFTER,
            ))
        else:
            exchange.fail(UpstreamUnavailable(
                "The upstream dropped the stream before its end.", retry_after=UNREACHABLE_RETRY_AFTER,
            ))

    # -- httptools' callbacks ---------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._raw_headers = []
        self._head_bytes = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > MAX_HEAD_BYTES:
            raise BadUpstreamResponse(
                f"The upstream's answer head is larger than {MAX_HEAD_BYTES} bytes; refused."
            )
        if _CONTROL.search(value) is None:
            self._raw_headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        exchange = self.exchange
        status = self.parser.get_status_code()
        self._informational = status < 200
        if exchange is None or self._informational:
            return
        headers = CIMultiDict(self._raw_headers)
        exchange.status = status
        exchange.headers = CIMultiDictProxy(headers)
        self._framed = "content-length" in headers or "chunked" in headers.get("transfer-encoding", "").lower() \
            or status in (204, 304)
        if not exchange.head.done():
            exchange.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        exchange = self.exchange
        if exchange is not None and not exchange.done:
            exchange.sink.body(body)

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        exchange, self.exchange = self.exchange, None
        keep = self.parser.should_keep_alive() and self._framed
        if exchange is not None:
            self.pool.active.discard(exchange)
        if exchange is not None and not exchange.done:
            exchange.done = True
            exchange.conn = None
            exchange.sink.end(None)
        if keep and not self.closed:
            self.pool.release(self)
        else:
            self.drop()

    # -- the pool's side --------------------------------------------------------------------------
    def send(self, exchange: Exchange, request: bytes) -> None:
        self.exchange = exchange
        exchange.conn = self
        exchange.read_at = self.pool.loop.time()
        self.pool.active.add(exchange)
        if self.transport is not None:
            self.transport.write(request)

    def pause(self) -> None:
        if not self.paused and self.transport is not None and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def drop(self) -> None:
        """Close at once (an answer cut short aborts the engine's request: vLLM sees its client leave)."""
        if not self.closed:
            self.closed = True
            self.exchange = None
            self.pool.forget(self)
            if self.transport is not None:
                self.transport.abort()


class Pool:
    """The engine's kept-alive connections: at most ``limit`` open, the idle ones reused newest first."""

    def __init__(
        self, host: str, port: int, tls: ssl.SSLContext | None, limit: int, keepalive: float,
        describe: Callable[[], str],
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.host, self.port, self.tls = host, port, tls
        self.limit, self.keepalive = limit, keepalive
        self.describe = describe  # the engine's URL, redacted, for messages
        self.idle: list[Connection] = []
        self.conns: set[Connection] = set()
        self.connecting = 0
        self.active: set[Exchange] = set()
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def connection(self, reuse: bool, timeout: float) -> tuple[Connection, bool]:
        """A connection for one exchange (a pooled one unless ``reuse`` is false); whether it was pooled."""
        while reuse and self.idle:
            conn = self.idle.pop()
            if not conn.closed and self.loop.time() - conn.idle_since < self.keepalive:
                return conn, True
            conn.drop()
        while len(self.conns) + self.connecting >= self.limit:
            waiter = self.loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
            if reuse and self.idle:
                return self.idle.pop(), True
        self.connecting += 1
        try:
            if self.host.startswith("/"):  # a Unix socket's path (a worker's way to the authority)
                opening = self.loop.create_unix_connection(lambda: Connection(self), self.host)
            else:
                opening = self.loop.create_connection(lambda: Connection(self), self.host, self.port, ssl=self.tls)
            _, conn = await asyncio.wait_for(opening, timeout)
        finally:
            self.connecting -= 1
        if not conn.closed:
            self.conns.add(conn)
        self._wake()
        return conn, False

    def release(self, conn: Connection) -> None:
        conn.idle_since = self.loop.time()
        self.idle.append(conn)
        self._wake()

    def forget(self, conn: Connection) -> None:
        """A connection closed (by either side): its place is free."""
        if conn in self.idle:
            self.idle.remove(conn)
        self.conns.discard(conn)
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def sweep(self, timeout_error: Callable[[Exchange], GatewayError]) -> None:
        """Fail exchanges past their deadline or silent too long; close connections idle past the keep-alive."""
        now = self.loop.time()
        for exchange in [e for e in self.active if e.done or now > e.deadline or now - e.read_at > e.silence]:
            self.active.discard(exchange)
            if not exchange.done:
                exchange.fail(timeout_error(exchange))
        for conn in [c for c in self.idle if now - c.idle_since >= self.keepalive]:
            conn.drop()

    def close(self) -> None:
        for conn in list(self.idle):
            conn.drop()
        for exchange in list(self.active):
            exchange.close()
        self.active.clear()
