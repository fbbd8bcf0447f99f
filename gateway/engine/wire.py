"""HTTP/1.1 to the engine on asyncio's protocols: one exchange per connection at a time, pooled and kept alive.

The gateway's client sits on the hottest path of every request and every streamed token, so it is built from
the event loop's own callbacks and the C parser (httptools, the one uvicorn reads requests with): an answer's
bytes go from ``data_received`` through the parser to the exchange's sink without a task switch, a future or a
timer per read. aiohttp, the client before, cost ~230 us of one core per short request more than this (its
request and response objects, a timer rescheduled on every read, a task wake per chunk), measured with a fast
fake engine: 326 against 95 us of the proxy's CPU per request at 64 concurrent (docs/overhead.md).

Three modules: this one holds an exchange (one request and its answer) and the sinks its body goes to;
``engine/connection.py`` one connection's state machine (connecting, idle, busy, closed), which decides when a
connection may carry another request; ``engine/pool.py`` the engine's connections. Silence and total time are not
timed per read: each exchange notes when its connection last read, and the pool's sweeper (``Pool.sweep``, run by
``engine/client.py`` a few times a second) fails exchanges past their limits and closes connections idle past the
keep-alive. Errors are ``GatewayError``s, raised in these modules and in ``client.py`` only.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Protocol

from multidict import CIMultiDict, CIMultiDictProxy

from gateway.errors import GatewayError

# Past this an answer's head (its status line, headers and any 1xx heads before it) is refused as it is read:
# vLLM's are ~200 bytes; a 70 KB header, or an endless one, is an upstream gone wrong.
MAX_HEAD_BYTES = 64 * 1024
# A reader (``BufferSink``) that lets this many bytes wait pauses the connection's reads until it catches up.
PAUSE_AT = 1024 * 1024
UNREACHABLE_RETRY_AFTER = 5.0


class Carrier(Protocol):
    """What an exchange asks of the connection that carries it (``connection.Connection``): the wire's records
    sit below the connection and its pool, and name only this."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def close(self) -> None: ...


class Sink(Protocol):
    """Where an exchange's body goes, as it arrives: ``body`` for each piece the parser reads out of one read of
    the socket (an HTTP chunk each: one read may bring many), then ``flush`` once that read is parsed whole, so
    that a sink hands its reader everything one read brought at once (one write to a client for all the events
    of one read); ``end`` after the last piece."""

    def body(self, data: bytes) -> None: ...

    def flush(self) -> None: ...

    def end(self, error: GatewayError | None) -> None: ...


class BufferSink:
    """Holds the body for a reader that awaits it (``next``), pausing the connection while it lags."""

    __slots__ = ("_chunks", "_ended", "_error", "_size", "_waiter", "exchange")

    def __init__(self, exchange: Exchange) -> None:
        self.exchange: Exchange | None = exchange  # None once the body has ended: see ``end``
        self._chunks: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._ended = False
        self._error: GatewayError | None = None
        self._waiter: asyncio.Future[None] | None = None

    def body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > PAUSE_AT and self.exchange is not None:
            self.exchange.pause()

    def flush(self) -> None:
        self._wake()  # once a read, not once a chunk: the reader takes all of them when it runs

    def end(self, error: GatewayError | None) -> None:
        self._ended, self._error = True, error
        # Nothing follows the end, so the exchange is let go: the two referring to each other were a cycle
        # that only the cyclic collector freed (with the exchange's future and headers), every request.
        self.exchange = None
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
        if self._size <= PAUSE_AT // 2 and self.exchange is not None:
            self.exchange.resume()
        return data


class ClosedSink:
    """The sink of a closed exchange: its reader is done, and whatever its connection still reports is dropped."""

    __slots__ = ()

    def body(self, data: bytes) -> None:
        return None

    def flush(self) -> None:
        return None

    def end(self, error: GatewayError | None) -> None:
        return None


CLOSED = ClosedSink()


class Exchange:
    """One request and its answer on one connection. ``head`` resolves with the answer's status and headers;
    the body then flows into ``sink`` (a ``BufferSink`` until a reader attaches another)."""

    __slots__ = (
        "conn", "deadline", "done", "error", "head", "headers", "limit", "read_at", "silence", "sink", "status",
    )

    def __init__(self, deadline: float, silence: float) -> None:
        self.deadline = deadline  # loop time by which the whole exchange must be over
        self.limit = 0.0  # the seconds that deadline allowed, for the timeout's message
        self.silence = silence  # seconds the engine may stay silent
        self.read_at = 0.0
        self.conn: Carrier | None = None
        self.head: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.status = 0
        self.headers: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())
        self.sink: Sink = BufferSink(self)
        self.done = False  # its answer ended, or it failed or was closed: its connection is no longer its own
        self.error: GatewayError | None = None

    def attach(self, sink: Sink) -> None:
        """Send the body to ``sink`` from now on, after what the buffer already holds."""
        held = self.sink
        self.sink = sink
        if isinstance(held, BufferSink):
            while held._chunks:
                sink.body(held._chunks.popleft())
            held._size = 0
            sink.flush()
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
            conn.close()

    def close(self) -> None:
        """The reader is done: a whole answer leaves its connection pooled; anything else drops it."""
        if not self.done:
            self.done = True
            if not self.head.done():
                self.head.cancel()
            if self.conn is not None:
                self.conn.close()
        # The sink is let go: a stream's sink holds its upstream stream, which holds this exchange, a reference cycle
        # every stream that only the cyclic collector freed (with the stream's reservation and its client's cycle).
        self.sink = CLOSED

    def pause(self) -> None:
        if self.conn is not None:
            self.conn.pause()

    def resume(self) -> None:
        if self.conn is not None:
            self.conn.resume()
