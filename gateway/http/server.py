"""The HTTP server: uvicorn with httptools, and a protocol that bounds what one connection may hold.

uvicorn's own protocol keeps a fresh connection that sends nothing open forever, accepts headers of any size
and number, answers parse errors in plain text (``Content-Length: 10^20`` included, as a 400), and caps
connections only through ``limit_concurrency``, whose answer is plain text too. ``GuardProtocol`` adds, per
connection and at no per-request cost beyond a few attribute updates:

- an idle timeout from the connection's last response, or its opening (closed silently), a header timeout
  from a request's first byte to the end of its headers (408), bounds on the header bytes and count (431); a
  deadline that passes while the client's bytes wait unread (the loop ran late) is judged once they are read;
- a ``Content-Length`` above ``--max-body-bytes``, absurd ones included, refused before the app runs (413),
  and a cap on clients' open connections (503 with ``Retry-After``); with ``--workers``, the workers' connections
  to the authority's private app socket (their forwarded ``/health``, ``/metrics``, models listing) are not
  clients': they never count against it, nor are refused;
- every refusal in OpenAI's JSON shape with ``connection: close``, then a lingering close so that a client
  still sending reads the answer instead of a reset (``_linger``);
- a request answered before its body was whole (401, 404) keeps its connection: the rest of the body is read
  and discarded under the body's own limits, and the connection idles only from the body's end;
- a write timeout (``stall``): a client that accepts no byte of its answer for ``--write-timeout`` seconds
  while its send buffer is full is cut.

The body's limits hold with one rule (``body.BodyLimits``) in two places: ``body.read_body`` checks each chunk,
and the connection's one timer cuts a body that stops arriving (noticing silence needs a timer; one per request
would cost more than reading the body). Moving between phases only records a deadline; the timer, when it
fires, re-arms itself at the current one.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any, ClassVar, NoReturn

import httptools
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.errors import (
    GatewayError,
    HeadersTooLarge,
    InvalidRequest,
    PayloadTooLarge,
    RequestTimeout,
    TooManyConnections,
)
from gateway.http.body import body_too_slow
from gateway.http.errors import status_and_type
from gateway.http.limits import ConnectionLimits
from gateway.http.refusals import head_too_large, parse_error, render
from gateway.http.stall import WriteStall, due
from gateway.http.stream_out import CONNECTION, ConnectionLink
from gateway.http.transport import LingeringTransport, unread

log = logging.getLogger(__name__)

# Seconds of silence after which a connection that ended with an answer (a refusal, an answer with
# ``connection: close``) stops reading and closes. Until then what the client sends is read and discarded, so
# that a client still sending reads the answer rather than a reset; its own close ends it sooner. A client still
# uploading (a 413, or the app's answer while its body arrived) keeps it longer while it sends, within the
# body's rule counted from the answer: the body timeout in all, the minimum rate after the grace.
LINGER = 1.0
# A header or body deadline that passes while the client's bytes wait unread is judged again this long after,
# once: the loop reads them first. uvloop runs the timers due before it polls for reads, so a loop that ran late
# (a busy host) saw deadlines pass over bytes that came in time (a 408 seen under load); any delay above zero
# puts the next poll before the timer.
LATE_READ = 0.01

# Connection phases: what the one timer means when it fires.
_IDLE, _HEAD, _BODY, _BUSY, _CLOSING = range(5)


class _Refused(Exception):
    """Raised inside a parser callback to stop parsing; the refusal itself is in ``GuardProtocol._refusal``."""


class GuardProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits above; ``protocol_class`` makes one bound to its limits."""

    limits: ClassVar[ConnectionLimits]
    _body_first: ClassVar[float]  # limits.body.due(0): seconds before a body that has not begun is late
    # Connections open on the private app socket (a Unix socket; the gateway's port is TCP). uvicorn keeps one set
    # of connections per server, every socket's; each server has its own class (``serving.protocol_class``), so
    # this count is the server's. The client cap counts the rest: with the authority holding its share of clients,
    # a worker's forwarded ``/health`` was refused (503), or written to a connection closed under it (500).
    _private_open: ClassVar[int] = 0

    # Slots keep the instance dict at uvicorn's own attributes: past 30 keys CPython stops sharing its keys,
    # and every attribute access of the protocol, uvicorn's included, got slower (measured: +5 us a request).
    __slots__ = (
        "_begin_read_len", "_body_raw", "_body_start", "_content_length", "_deadline", "_deferred", "_head_raw",
        "_late_read", "_messages", "_on_lost", "_phase", "_private", "_read_len", "_refusal", "_stall", "_timer",
        "_timer_at", "_uploading",
    )

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._phase = _IDLE
        self._deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at, self._read_len = 0.0, 0  # _read_len: bytes of the read being parsed
        self._begin_read_len = 0  # bytes of the read in which the current request began
        self._head_raw = 0  # bytes of later reads that ended with the current request's head still incomplete
        self._messages = 0  # requests begun on this connection
        self._content_length: bytes | None = None
        self._body_start = 0.0  # loop time the current request's head was complete
        self._body_raw = 0  # bytes of reads that ended with the current request's body still incomplete
        self._refusal: GatewayError | None = None
        self._deferred: GatewayError | None = None  # a refusal waiting for the answer before it
        self._uploading = False  # lingering, the client was sending a body: its bytes extend the linger
        self._late_read = False  # the current head's or body's deadline was deferred for unread bytes (once)
        self._stall = WriteStall(self.loop, self.limits.write_timeout, stretch=self.limits.stretch)
        self._on_lost: Callable[[], None] | None = None  # a stream's to call when the client goes away
        self._private = False  # on the private app socket: a worker's, not a client's

    # -- the one timer ----------------------------------------------------------------------------
    def _arm(self, phase: int, deadline: float) -> None:
        self._phase = phase
        self._deadline = deadline
        if self._timer is None or deadline < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_at(deadline, self._on_timer)
            self._timer_at = deadline

    def _on_timer(self) -> None:
        self._timer = None
        deadline = self._deadline
        if deadline is None or self.parser is None:
            return
        since = self._body_start if self._phase == _BODY else deadline - self.limits.header_timeout
        deadline = due(since, deadline, self.loop.time(), self.limits.stretch) if self._phase < _BUSY else deadline
        if deadline - self.loop.time() > 0.005:  # the phase moved on since the timer was set, or the host starved
            self._timer = self.loop.call_at(deadline, self._on_timer)
            self._timer_at = deadline
            return
        if self._phase in (_HEAD, _BODY) and not self._late_read and unread(self.transport):
            # The loop ran late, and bytes that may have come in time wait unread: judged once they are read.
            self._late_read = True
            self._arm(self._phase, self.loop.time() + LATE_READ)
        elif self._phase == _HEAD:
            seconds = self.limits.header_timeout
            self._refuse(RequestTimeout(f"The request line and headers did not arrive within {seconds:g} seconds."))
        elif self._phase == _BODY:
            self._body_late()
        elif self._phase == _IDLE and unread(self.transport):
            # The loop ran late, and a request sent within the keep-alive (or the client's close) waits unread:
            # closing would reset it. Its read moves the phase on.
            self._arm(_IDLE, self.loop.time() + self.limits.keep_alive_timeout)
        else:  # idle, or done lingering
            self._deadline = None
            self.transport.close()

    # -- the write timeout (``stall``) -------------------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        self._stall.paused(self.transport)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stall.resumed()

    # -- connection events ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(LingeringTransport(transport, self._closing))  # type: ignore[arg-type]
        sock = transport.get_extra_info("socket")
        cls = type(self)
        if sock is not None and sock.family == socket.AF_UNIX:
            self._private = True
            cls._private_open += 1
        limit = self.limits.max_connections
        if not self._private and len(self.connections) - cls._private_open > limit:
            self._refuse(TooManyConnections(
                f"The gateway has its limit of {limit} connections open; retry shortly.", retry_after=1
            ))
            return
        # A pool opens a connection to send on it at once: the long keep-alive is for those kept after an answer.
        self._arm(_IDLE, self.loop.time() + min(self.limits.keep_alive_timeout, self.limits.header_timeout))

    def connection_lost(self, exc: Exception | None) -> None:
        if self._private:
            self._private = False
            type(self)._private_open -= 1
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._stall.resumed()
        self._deadline = None
        super().connection_lost(exc)
        self.transport.let_go()  # type: ignore[attr-defined]  # the LingeringTransport of connection_made
        lost, self._on_lost = self._on_lost, None
        if lost is not None:
            lost()

    def on_lost(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` (once) if the connection is lost: a stream's, while it writes straight to the
        transport (``stream_out.DirectOut``); None: no more."""
        self._on_lost = callback

    def data_received(self, data: bytes) -> None:
        phase, messages = self._phase, self._messages
        if phase == _CLOSING:
            if self._uploading:
                self._lingered(len(data))
            return
        self._read_len = len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # The gateway serves no upgrades: as uvicorn does, the request was handed to the app as plain HTTP.
            if self._should_upgrade():
                self.handle_websocket_upgrade()
                return
        except httptools.HttpParserError as exc:
            refusal, self._refusal = self._refusal, None
            self._refuse(refusal or parse_error(exc, self.limits))
            return
        if self._phase == _BODY:
            if self.cycle.more_body:
                self._body_raw += len(data)
                if self.cycle.response_complete and self._body_raw > self.limits.body.max_bytes:
                    self._linger(uploading=False)  # answered already; the rest of its body is too large to read
            else:
                self._phase = _BUSY
                self._deadline = None
        elif self._phase == _HEAD and phase == _HEAD and self._messages == messages:
            # A whole read inside one head: bound the head here, or one endless header would grow in the
            # parser's buffer unchecked (it reaches the protocol only once complete).
            self._head_raw += len(data)
            if self._head_raw > self.limits.max_header_bytes:
                self.headers.clear()  # no app has this request's scope yet
                self._refuse(head_too_large(self._head_raw, self.limits))

    def _body_late(self) -> None:
        """The body's deadline passed: refuse it, unless the bytes since have earned a later one. A body whose
        request was answered already is only being discarded: then the connection closes, the answer sent."""
        body = self.limits.body
        cycle = self.cycle
        if cycle.response_started and not cycle.response_complete:  # answering: its end re-arms this
            self._deadline = None
            return
        deadline = self._body_start + body.due(self._body_raw)
        now = self.loop.time()
        if deadline - now > 0.005:
            self._arm(_BODY, deadline)
            return
        if cycle.response_complete:
            self._linger(uploading=False)
            return
        self._refuse(body_too_slow(body, self._body_raw, now - self._body_start))

    # -- parser callbacks -------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_raw = 0
        self._begin_read_len = self._read_len
        self._messages += 1
        self._content_length = None
        self._late_read = False
        self._arm(_HEAD, self.loop.time() + self.limits.header_timeout)

    def on_header(self, name: bytes, value: bytes) -> None:
        # uvicorn's, plus noting Content-Length: the one place that runs per header, so nothing more is done
        # here; sizes are checked once the head is complete.
        name = name.lower()
        if name == b"content-length":
            self._content_length = value
        elif name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._phase = _BUSY
        self._deadline = None
        limits = self.limits
        # The head is no larger than the reads it came in: most heads come in one small read, and only a
        # large read (a body along with it) needs the exact sum.
        if self._head_raw + self._begin_read_len + self._read_len > limits.max_header_bytes:
            size = len(self.url) + sum(len(name) + len(value) for name, value in self.headers)
            if size > limits.max_header_bytes:
                self._refuse_head(head_too_large(size, limits))
        if len(self.headers) > limits.max_headers:
            self._refuse_head(HeadersTooLarge(
                f"The request has {len(self.headers)} headers; the limit is {limits.max_headers}."
            ))
        declared = self._content_length
        if declared is not None and declared.strip().isdigit() and int(declared) > limits.body.max_bytes:
            self._refuse_head(PayloadTooLarge(
                f"The request body is {int(declared)} bytes (Content-Length); "
                f"the limit is {limits.body.max_bytes} bytes."
            ))
        super().on_headers_complete()
        self.transport.hold_head()  # type: ignore[attr-defined]  # (LingeringTransport) head and body in one write
        self.scope["extensions"] = {CONNECTION: ConnectionLink(self, self.cycle)}  # type: ignore[dict-item]
        # Until the body is whole (data_received sees it), the body's limits hold.
        now = self.loop.time()
        self._body_start = now
        self._body_raw, self._late_read = 0, False
        self._arm(_BODY, now + self._body_first)

    def _refuse_head(self, error: GatewayError) -> NoReturn:
        """Stop the parser from inside its callback; ``data_received`` answers ``error``."""
        self.headers.clear()  # no app has this request's scope: free what a flood of headers holds now
        self._refusal = error
        raise _Refused

    def on_response_complete(self) -> None:
        # uvicorn's, with the idle deadline in place of its per-response keep-alive timer.
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        elif self._deferred is not None:
            error, self._deferred = self._deferred, None
            self._answer(error)
        elif self._phase == _BUSY:  # not when the next request's head is already arriving
            self._arm(_IDLE, self.loop.time() + self.limits.keep_alive_timeout)
        elif self._phase == _BODY:
            # Answered before its body was whole (a 401, a 404): the parser discards the rest, which is held to
            # the body's limits; the connection idles from the body's end (``on_message_complete``). An idle
            # deadline from here cut a client still sending its body with a reset.
            self._arm(_BODY, self._body_start + self.limits.body.due(self._body_raw))

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self._phase == _BODY and self.cycle.response_complete:  # the rest of an answered body, discarded
            self._arm(_IDLE, self.loop.time() + self.limits.keep_alive_timeout)

    def send_400_response(self, msg: str) -> None:
        self._refuse(InvalidRequest(f"Malformed HTTP request: {msg}", code="malformed_request"))

    # -- refusing ---------------------------------------------------------------------------------
    def _refuse(self, error: GatewayError) -> None:
        """Answer ``error`` in OpenAI's shape and close, whatever the connection was doing."""
        if self._phase == _CLOSING or self.transport.is_closing():
            return
        log.debug("refused a connection from %s: %s %s", self.client, status_and_type(error)[0], error.message)
        self._phase = _CLOSING  # from here on, what the client sends is discarded
        self._deadline = None
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if not cycle.more_body:
                # The request being answered arrived whole; the refusal is about what came after it (pipelined),
                # so it follows that answer (and any requests queued before it).
                self._deferred = error
                return
            # Its body was being read: the app's reads end and its writes are dropped from here on.
            cycle.disconnected = True
            cycle.message_event.set()
            if cycle.response_started:  # too late for an answer of our own
                self.transport.close()
                return
        self._answer(error)

    def _answer(self, error: GatewayError) -> None:
        self.transport.write(render(error, self.server_state.default_headers))
        self._linger(uploading=isinstance(error, PayloadTooLarge))

    def _closing(self) -> bool:
        """uvicorn closes the connection (``LingeringTransport.close``): linger if its body was still arriving."""
        transport = self.transport
        if self._phase != _BODY or not transport.can_write_eof() or transport.is_closing():
            return False
        self._linger(uploading=True)
        return True

    def _linger(self, *, uploading: bool) -> None:
        """End the connection after its last answer: half-close, then read and discard what the client still
        sends until it closes or falls silent for ``LINGER`` seconds; ``uploading``: it was sending a body, which
        may go on as a body may arrive, counted from here (``_lingered``)."""
        transport = self.transport
        if not transport.can_write_eof() or transport.is_closing():
            transport.close()
            return
        now = self.loop.time()
        self._phase = _CLOSING  # from here on, what the client sends is discarded
        self._uploading = uploading
        self._body_start, self._body_raw = now, 0  # lingering, they count the bytes discarded
        transport.write_eof()
        self.flow.resume_reading()
        self._arm(_CLOSING, now + LINGER)

    def _lingered(self, size: int) -> None:
        """``size`` bytes more of an upload arrived while lingering: ``LINGER`` seconds more, within the body's
        rule from the answer on (``--body-timeout`` in all, ``--min-body-rate`` after its grace). Only the
        deadline moves; the timer re-arms itself when it fires."""
        self._body_raw += size
        now = self.loop.time()
        self._deadline = min(now + LINGER, self._body_start + max(LINGER, self.limits.body.due(self._body_raw)))
