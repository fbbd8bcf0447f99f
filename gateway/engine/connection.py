"""One connection to the engine, as a state machine: it carries one exchange at a time, and is reused only after
a complete, well-framed answer with nothing behind it.

    CONNECTING --made--> IDLE --send--> BUSY --answer ended, kept alive, nothing behind it--> IDLE (pooled)
         |                 |              |
         +-----------------+--------------+--any parse error, surplus byte, unasked answer, close, loss--> CLOSED

Only the move from BUSY to IDLE hands the connection back to the pool, so it is released exactly once per
exchange. Bytes that come while it is IDLE (an answer nobody asked for) close it; so does the start of a second
answer behind the exchange's own, in the same read or later. An answer's head is capped while it is read
(``MAX_HEAD_BYTES``, counted on the bytes handed to the parser before the head's end, so that an endless header
or reason phrase never accumulates in it). The request's bytes are watched too: the transport tells
(``pause_writing``/``resume_writing``, its buffer limit at zero) while part of a request still waits in its
buffer, which is how a lost connection says whether the upstream can have read the request whole.

All of this costs a few attribute reads per read of the socket: no task, timer or future per read (``wire.py``).
"""

from __future__ import annotations

import asyncio
import enum
import re
import select
from typing import Protocol

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.engine.wire import MAX_HEAD_BYTES, Exchange
from gateway.errors import BadUpstreamResponse, GatewayError, UpstreamLost

_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


class State(enum.IntEnum):  # (an int: hashed and compared in C, on every request)
    CONNECTING = 0  # being opened: never handed out
    IDLE = 1  # open with no exchange: pooled, or just opened and about to carry one
    BUSY = 2  # carrying one exchange
    CLOSED = 3  # for good


# The moves each state allows, by the state's number.
_MOVES: tuple[tuple[State, ...], ...] = (
    (State.IDLE, State.CLOSED),  # CONNECTING
    (State.BUSY, State.CLOSED),  # IDLE
    (State.IDLE, State.CLOSED),  # BUSY
    (),  # CLOSED
)


class Home(Protocol):
    """What a connection asks of the pool that made it (``pool.Pool``): where it goes back once its answer is
    whole, where it is forgotten once closed, and the exchanges in flight. Named here so that the connection,
    below its pool, does not import it."""

    loop: asyncio.AbstractEventLoop
    active: set[Exchange]

    def release(self, conn: Connection) -> None: ...

    def forget(self, conn: Connection) -> None: ...


class Connection(asyncio.Protocol):
    """One kept-alive connection to the engine; the parser's callbacks feed the exchange it carries."""

    def __init__(self, pool: Home) -> None:
        self.pool = pool
        self._time = pool.loop.time
        self.state = State.CONNECTING
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        # A header value with a control character (``Retry-After: soon\x7f``) fails the whole answer in the strict
        # parser; it is read, and the field dropped (``on_header``), as a lenient client would.
        self.parser.set_dangerous_leniencies(lenient_headers=True)
        self.exchange: Exchange | None = None  # set exactly while BUSY
        self.idle_since = 0.0
        self.paused = False
        self._poll: select.poll | None = None  # the socket, polled for bytes or an end before it is reused
        self._unsent = False  # part of the request waits in the transport's buffer
        self._heading = False  # reading an answer's head (1xx heads included)
        self._head_room = 0  # bytes the head may still take
        self._raw_headers: list[tuple[str, str]] = []
        self._framed = True  # the answer has a length or chunks (else it ends with the connection)
        self._informational = False
        self._complete = False  # the exchange's answer ended inside the read being parsed
        self._keep = False  # ... and the upstream keeps the connection alive after it

    def _move(self, to: State) -> None:
        assert to in _MOVES[self.state], f"a connection cannot go from {self.state.name.lower()} to {to.name.lower()}"
        self.state = to

    # -- asyncio's callbacks ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        stream: asyncio.Transport = transport  # type: ignore[assignment]  # a stream one (uvloop's is no subclass)
        self.transport = stream
        # At zero, the transport says (pause_writing) whenever a write leaves bytes in its buffer, and
        # (resume_writing) when they are all out.
        stream.set_write_buffer_limits(high=0)
        sock = transport.get_extra_info("socket")
        # Not under TLS: its socket may hold records for the TLS layer alone (session tickets), no end.
        if sock is not None and hasattr(select, "poll") and transport.get_extra_info("sslcontext") is None:
            self._poll = select.poll()
            self._poll.register(sock.fileno(), select.POLLIN)
        self._move(State.IDLE)

    def pause_writing(self) -> None:
        self._unsent = True

    def resume_writing(self) -> None:
        self._unsent = False

    def data_received(self, data: bytes | memoryview) -> None:
        exchange = self.exchange
        if exchange is None:  # bytes while idle: an answer nobody asked for; the connection is not safe to reuse
            self.close()
            return
        exchange.read_at = self._time()
        if self._heading:
            room = self._head_room
            if len(data) > room:
                self._past_head_room(data, room)
                return
            self._head_room = room - len(data)
        try:  # (``_feed``, inline: this runs on every read)
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._unreadable(exc)
            return
        if not exchange.done:  # (an ended one's sink has had everything: ``end`` hands on what it held)
            exchange.sink.flush()  # the read's body pieces, handed on together
        if self._complete:
            self._complete = False
            self._finish()

    def connection_lost(self, exc: Exception | None) -> None:
        exchange = self.exchange
        if self.state is not State.CLOSED:
            self._move(State.CLOSED)
            self.exchange, self._poll = None, None
            self.pool.forget(self)
        if exchange is None or exchange.done:
            return
        if exchange.head.done() and not self._framed and exc is None:
            exchange.done = True  # an answer without a length ends with its connection (closed, not reset)
            exchange.sink.end(None)
            return
        if not exchange.head.done():
            exchange.fail(UpstreamLost(
                "The upstream closed the connection before answering.", may_have_read=not self._unsent,
            ))
        else:
            exchange.fail(UpstreamLost("The upstream dropped the stream before its end.", may_have_read=True))

    # -- reading ----------------------------------------------------------------------------------
    def _feed(self, data: bytes | memoryview) -> None:
        exchange = self.exchange
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._unreadable(exc)
            return
        if exchange is not None and not exchange.done:
            exchange.sink.flush()
        if self._complete:
            self._complete = False
            self._finish()

    def _unreadable(self, exc: Exception) -> None:
        cause = exc.__context__  # a callback's own error (raised below, or by a sink under one)
        if isinstance(exc, httptools.HttpParserCallbackError) and isinstance(cause, GatewayError):
            self._fail(cause)
        elif isinstance(exc, httptools.HttpParserCallbackError):
            self._fail(BadUpstreamResponse(f"The upstream's answer could not be read: {exc}."))
        else:
            self._fail(BadUpstreamResponse(f"The upstream sent an invalid HTTP response: {exc}."))

    def _past_head_room(self, data: bytes | memoryview, room: int) -> None:
        """A read that runs past the head's cap: what fits is parsed alone; a head that did not end within it is
        refused at once, else the rest is read as the body (or as surplus)."""
        view = memoryview(data)
        self._head_room = 0
        self._feed(view[:room])
        if self._heading and self.state is State.BUSY:
            self._fail(BadUpstreamResponse(
                f"The upstream's answer head is longer than {MAX_HEAD_BYTES} bytes (status line and headers); "
                "refused."
            ))
        elif self.state is not State.CLOSED:
            self.data_received(view[room:])

    def _finish(self) -> None:
        """The exchange's answer ended whole, with nothing behind it in the read: the connection goes back to
        the pool if the upstream keeps it alive; else it is closed."""
        if self.state is not State.BUSY:
            return  # closed while its answer was read
        self.exchange = None
        transport = self.transport
        if transport is None or transport.is_closing() or not self._keep:
            self.close()
            return
        if self.paused:  # a slow reader paused it just as its answer ended: the next exchange reads again
            self.paused = False
            transport.resume_reading()
        self._move(State.IDLE)
        self.idle_since = self._time()
        self.pool.release(self)

    def _fail(self, error: GatewayError) -> None:
        exchange = self.exchange
        if exchange is not None and not exchange.done:
            exchange.fail(error)  # which closes this connection
        self.close()

    # -- httptools' callbacks ---------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self._complete or self.exchange is None:
            raise BadUpstreamResponse("The upstream sent more after its answer's end; the connection is dropped.")
        self._raw_headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        if _CONTROL.search(value) is None:
            self._raw_headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:
            self._informational = True  # its head counts against the cap; the answer's own comes after it
            return
        self._heading = False
        exchange = self.exchange
        if exchange is None or exchange.head.done():
            return
        headers = CIMultiDict(self._raw_headers)
        exchange.status = status
        exchange.headers = CIMultiDictProxy(headers)
        self._framed = "content-length" in headers or "chunked" in headers.get("transfer-encoding", "").lower() \
            or status in (204, 304)
        exchange.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        exchange = self.exchange
        if exchange is not None and not exchange.done:
            exchange.sink.body(body)

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        exchange = self.exchange
        if exchange is None:
            return
        self._complete = True  # ``_feed`` pools the connection once the whole read was parsed
        self._keep = self._framed and self.parser.should_keep_alive()  # (the parser forgets it past this call)
        self.pool.active.discard(exchange)
        if not exchange.done:
            exchange.done = True
            exchange.conn = None
            exchange.sink.end(None)

    # -- the pool's side --------------------------------------------------------------------------
    def is_open(self) -> bool:
        transport = self.transport
        return self.state is State.IDLE and transport is not None and not transport.is_closing()

    def usable(self) -> bool:
        """Idle, open, and with nothing waiting to be read: an engine that closed a pooled connection (or wrote to
        it) meanwhile may not have been heard yet by the loop, but its socket already says so."""
        transport, poll = self.transport, self._poll
        if self.state is not State.IDLE or transport is None or transport.is_closing():
            return False
        return poll is None or not poll.poll(0)

    def send(self, exchange: Exchange, request: bytes) -> None:
        self._move(State.BUSY)
        self.exchange = exchange
        exchange.conn = self
        exchange.read_at = self._time()
        self._heading, self._head_room, self._framed, self._complete = True, MAX_HEAD_BYTES, True, False
        self.pool.active.add(exchange)
        assert self.transport is not None
        self.transport.write(request)

    def pause(self) -> None:
        if not self.paused and self.state is State.BUSY and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.state is State.BUSY and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        """Close at once, for good (an answer cut short aborts the engine's request: vLLM sees its client leave)."""
        if self.state is State.CLOSED:
            return
        self._move(State.CLOSED)
        exchange, self.exchange, self._poll = self.exchange, None, None
        self.pool.forget(self)
        if exchange is not None and not exchange.done:
            exchange.fail(UpstreamLost("The connection to the upstream was closed under the request.",
                                       may_have_read=True))
        if self.transport is not None:
            self.transport.abort()
