"""The exchange with the engine: send a guarded request, read its answer whole or relay it as events, and teach
the reservation what was generated. Every opened upstream request is closed, and counted in and out of the
in-flight gauge, exactly once.

A whole answer is read here (``read_answer``). A stream is relayed to its client from the event loop's own
callbacks: the engine's bytes arrive in the upstream connection's ``data_received`` (``engine/wire.py``); an
``EngineStream`` is that exchange's sink: it cuts the bytes into whole server-sent events (``SSEFramer``), reads
the engine's counts off them and takes out what the client did not ask for (``StreamUsage``), teaches the
reservation what was generated, and hands the events to the client's writer (``StreamOut``, the HTTP layer's),
all in the callback: no task, queue or await per event. The engine is read at its own pace whatever the client
does, so the reservation is freed when the engine's stream ends; what the client has not read yet waits in its
connection's buffer, bounded by the writer, which cuts a client that falls too far behind (``ClientTooSlow``).

``EngineStream.relay`` returns a future that resolves when the stream is over: None once it ended well, or the
``GatewayError`` that broke it (to be written after the last whole event). ``finish`` frees everything exactly
once, whether the stream ended, broke, was cut, or never started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Protocol

import orjson

from gateway.engine.client import UpstreamStream, decoder_for
from gateway.engine.engine import Engine
from gateway.engine.sse import SSEFramer, require_event_stream
from gateway.engine.usage import EVERYTHING, StreamUsage, UsageAsk
from gateway.engine.vllm_api import upstream_error_from
from gateway.errors import BadUpstreamResponse, EngineQueueFull, GatewayError, UpstreamHung
from gateway.guard.context import Booking, RequestContext
from gateway.guard.models import Models
from gateway.guard.parts import Parts
from gateway.guard.seams import Held
from gateway.observe.tracing import OFF, RequestTrace

log = logging.getLogger(__name__)

# vLLM's API server runs a request on this data-parallel engine instead of balancing it itself
# (vllm/entrypoints/generate/base/serving.py, vLLM 0.32).
DP_RANK_HEADER = "x-data-parallel-rank"


@dataclass(frozen=True, slots=True)
class Reply:
    """The guard's answer: a whole JSON ``body``, or the head of a ``stream`` whose events the HTTP layer relays
    (``EngineStream.relay``)."""

    headers: dict[str, str]
    body: bytes | None = None
    stream: EngineStream | None = None



async def exchange_with_engine(
    parts: Parts, ctx: RequestContext, body: bytes, booking: Booking, reservation: Held,
    ask: UsageAsk = EVERYTHING, *, trace: Mapping[str, str] | None = None, resend: bool = True,
) -> AsyncGenerator[Reply, None]:
    """Forward and read the answer whole, or open the stream and hand its events to the HTTP layer, holding
    the reservation until the HTTP layer closes this generator. Upstream errors raised here come before
    anything was sent to the client (they may be retried); a stream's own break comes while the HTTP layer
    reads its events, and is the HTTP layer's to write as an error event. ``trace``: the W3C trace headers the
    engine joins the request's trace with (``open_upstream``)."""
    target = reservation.target
    engine = parts.engine_at(target.engine) if target is not None else parts.engine
    rank = target.rank if target is not None else None
    ctx.outcome.engine = target.name if target is not None else None
    patience = ctx.deadline if ctx.deadline is not None else parts.settings.queue_timeout
    reservation.sent()
    stream = await open_upstream(
        parts, engine, ctx.path, body, ctx.request_id, rank, trace, patience, resend=resend, events=booking.stream
    )
    if not booking.stream:
        learner = reservation if booking.learns_output else None
        payload = await read_answer(parts, engine, ctx.route, stream, learner)
        ctx.trace.answer(payload)
        ctx.outcome.output = learner
        # The engine is done with it: free the blocks before the answer is written to the client.
        reservation.release(completed=booking.learns_output)
        yield Reply(ctx.outcome.headers(), payload)
        return
    relay = EngineStream(parts, engine, ctx.route, stream, reservation, ask)
    ctx.outcome.output = reservation  # counts the stream's tokens as they are relayed
    try:
        headers = {**ctx.outcome.headers(), "cache-control": "no-cache", "x-accel-buffering": "no"}
        yield Reply(headers, stream=relay)
    finally:
        relay.finish()


async def open_upstream(
    parts: Parts, engine: Engine[Models], path: str, body: bytes, rid: str, rank: int | None = None,
    trace: Mapping[str, str] | None = None, patience: float | None = None, *, resend: bool = True,
    events: bool = False,
) -> UpstreamStream:
    """The upstream's answer once its status is 200, and (``events``) once it is an event stream; its error,
    normalised, otherwise. Counted in flight until closed by the caller. ``patience``: seconds the request may
    wait for a connection (an engine whose API server accepts late is waited on within the request's own time,
    not failed at --connect-timeout);
    ``rank``: the data-parallel engine behind ``engine``'s URL to run it on;
    ``trace``: the W3C trace headers that make the engine's spans children of the gateway's exchange;
    ``resend``: whether the client may send it once more when the engine cannot have read it (``Upstream.open``)."""
    parts.metrics.in_flight.inc()
    progress = engine.progress
    progress.opened()
    headers = {"content-type": "application/json", "x-request-id": rid, **(trace or {})}
    if rank is not None:
        headers[DP_RANK_HEADER] = str(rank)
    try:
        with progress.interruptible():  # refused while the engine is hung, cut if it hangs meanwhile
            stream = await engine.client.open(
                "POST", path, body=body, headers=headers, connect_within=patience, resend=resend
            )
    except BaseException:
        parts.metrics.in_flight.dec()
        progress.closed()
        raise
    if stream.status != 200:
        try:
            payload = await stream.read_all()
        finally:
            close(parts, engine, stream)
        error = upstream_error_from(stream.status, payload, stream.headers)
        if isinstance(error, EngineQueueFull):
            engine.queue_cap.refused(error.retry_after or 0.0)  # nothing more placed on it for now
        raise error
    if events:
        try:
            require_event_stream(stream)
        except GatewayError:
            close(parts, engine, stream)
            raise
    return stream


def close(parts: Parts, engine: Engine[Models], stream: UpstreamStream) -> None:
    stream.close()
    parts.metrics.in_flight.dec()
    engine.progress.closed()
    engine.queue_cap.room()  # a request left the engine: its own queue cap has a place again


async def read_answer(
    parts: Parts, engine: Engine[Models], route: str, stream: UpstreamStream, reservation: Held | None
) -> bytes:
    """A whole JSON answer; its usage teaches the reservation how long outputs really are (``reservation``
    None: the route generates nothing, like the pooling routes)."""
    t0 = time.perf_counter()
    try:
        with engine.progress.interruptible():
            payload = await stream.read_all()
        engine.progress.answered()  # a whole answer is progress, even from an engine whose metrics never move
    finally:
        close(parts, engine, stream)
    parts.metrics.record_upstream_latency(route, time.perf_counter() - t0)
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise BadUpstreamResponse("The upstream answered 200 with a body that is not JSON.") from exc
    if not isinstance(data, dict):
        kind = "null" if data is None else type(data).__name__
        raise BadUpstreamResponse(f"The upstream answered 200 with a JSON {kind} where an object was expected.")
    generated = output_tokens(data.get("usage")) if reservation is not None else None
    if generated is not None and reservation is not None:
        parts.metrics.record_output_tokens(generated)
        reservation.observe_output_tokens(generated)
    parts.metrics.record_request(route, "ok")
    return payload


def output_tokens(usage: object) -> int | None:
    """Generated tokens from an answer's usage: ``completion_tokens`` (chat, completions) or ``output_tokens``
    (Responses)."""
    if not isinstance(usage, dict):
        return None
    value = usage.get("completion_tokens", usage.get("output_tokens"))
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    return value


# -- a stream, relayed event by event ------------------------------------------------------------
class StreamOut(Protocol):
    """The client's side of a stream: whole events written in one go (one chunk each)."""

    def send(self, events: list[bytes]) -> None:
        """Write ``events``; raises ``ClientTooSlow`` when the client lets too much wait unread."""


class EngineStream:
    __slots__ = (
        "_arrived", "_counted", "_decoder", "_done", "_error", "_first", "_framer", "_hang", "_out", "_over",
        "_pending", "_trace", "_watch", "engine", "outcome", "parts", "reservation", "route", "stream", "t0", "usage",
    )

    def __init__(
        self, parts: Parts, engine: Engine[Models], route: str, stream: UpstreamStream, reservation: Held,
        ask: UsageAsk = EVERYTHING,
    ) -> None:
        self.parts, self.route, self.stream, self.reservation = parts, route, stream, reservation
        self.engine = engine
        self.usage = StreamUsage(route, ask, engine.fingerprint)
        self.t0 = time.perf_counter()
        self.outcome = "cancelled"  # until the stream ends or breaks
        self._framer = SSEFramer(parts.settings.max_stream_event_bytes)
        self._decoder = decoder_for(stream.headers)  # an upstream that compressed though asked not to
        self._first = True
        self._over = False
        self._out: StreamOut | None = None
        self._pending: list[bytes] = []  # the events of the read being parsed, written together at its end
        self._arrived = False  # bytes came in the read being parsed (the engine moved)
        self._counted = False  # ... and whole events, whose counts teach the reservation
        self._trace: RequestTrace = OFF
        self._done: asyncio.Future[GatewayError | None] | None = None
        self._error: BaseException | None = None  # what broke the stream, for its trace
        # A hung engine sends nothing more: the detector closes the stream, and its break is told as the hang.
        self._hang: UpstreamHung | None = None
        self._watch = engine.progress.watch(self._cut)

    def relay(self, out: StreamOut, trace: RequestTrace = OFF) -> asyncio.Future[GatewayError | None]:
        """Relay the engine's events to ``out`` as they arrive; the future says how the stream ended."""
        self._out, self._trace = out, trace
        self._done = asyncio.get_running_loop().create_future()
        if self._over:
            self._done.set_result(None)
        else:
            self.stream.attach(self)
        return self._done

    # -- the exchange's sink: called from the upstream connection's callbacks ---------------------------
    def body(self, data: bytes) -> None:
        if self._over:
            return
        self._arrived = True
        try:
            decoder = self._decoder
            events = self._framer.feed(decoder.decode(data, self._framer.limit) if decoder is not None else data)
            if not events:
                return
            if self._first:
                self._first = False
                self.parts.metrics.record_ttft(self.route, time.perf_counter() - self.t0)
            self._pending += self.usage.feed(events)
            self._counted = True
        except GatewayError as exc:
            self._break(exc)
        except BaseException as exc:  # a fault of ours: the stream ends, nothing leaks
            self._fault(exc)

    def flush(self) -> None:
        """The read is parsed: its events go to the client in one write (vLLM writes each event on its own, but
        a busy host reads several at once: one write each cost the gateway a system call and the client a
        wake-up per event), and the engine's count so far teaches the reservation. Called with nothing read (a
        stream attached before its first bytes), it does nothing: a head is no movement of the engine's, and a
        request not yet seen generating is not counted as running."""
        if self._over or not self._arrived:
            return
        self._arrived = False
        self.engine.progress.stream_moved()
        if self._counted:
            self._counted = False
            self.reservation.observe_output_tokens(self.usage.generated)
        events = self._pending
        if events:
            self._pending = []
            try:
                self._send(events)
            except GatewayError as exc:
                self._break(exc)
            except BaseException as exc:
                self._fault(exc)

    def end(self, error: GatewayError | None) -> None:
        if self._over:
            return
        if error is not None:
            self._break(error)
            return
        try:
            decoder = self._decoder
            tail = self._framer.feed(decoder.finish()) if decoder is not None else []
            usage = self.usage
            events = self._pending + usage.feed(tail + self._framer.close()) + usage.close()
            self._pending = []
            self.reservation.observe_output_tokens(usage.generated)
            self.outcome = "ok"
            if events:
                self._send(events)
        except GatewayError as exc:
            self._break(exc)
            return
        except BaseException as exc:
            self._fault(exc)
            return
        self._settle(None)

    # -- how it ends -------------------------------------------------------------------------------------
    def _send(self, events: list[bytes]) -> None:
        self._trace.stream_events(events)
        if self._out is not None:
            self._out.send(events)

    def _break(self, exc: GatewayError) -> None:
        if self.outcome != "ok":  # the engine's own end was whole: only the client was cut
            self.outcome = "cancelled" if exc.code == "client_too_slow" else "error"
        # The read's events not yet written, then the chunks held for a usage chunk that will not come.
        held, self._pending = self._pending + self.usage.close(), []
        if held and self._out is not None:
            with contextlib.suppress(GatewayError):  # the client is cut anyway; the first error is the one told
                self._out.send(held)
        error: GatewayError = self._hang if self._hang is not None else exc
        self._error = error
        if error.code != "client_too_slow":
            log.warning("stream cut by the upstream: %s", error.message)
        else:
            log.warning("stream cut: %s", error.message)
        self._settle(error)  # closing the stream (``finish``) drops its connection: the engine's request is aborted

    def _fault(self, exc: BaseException) -> None:
        self.outcome = "error"
        self._error = exc
        self.finish()
        if self._done is not None and not self._done.done():
            self._done.set_exception(exc)

    def _settle(self, error: GatewayError | None) -> None:
        self.finish()
        done = self._done
        if done is not None and not done.done():
            done.set_result(error)

    def cancel(self) -> None:
        """The client went away: the engine's request is aborted (``finish`` closes the stream) and everything
        freed."""
        self._settle(None)

    def _cut(self, hang: UpstreamHung) -> None:
        self._hang = hang
        self.end(hang)

    def finish(self) -> None:
        """Synchronous on purpose: this also runs in a task cancelled because its client went away. A cut
        stream's short output must not teach admission that outputs are short: only "ok" completes. Called when
        the stream is over, and again (a no-op then) when the pipeline closes."""
        if self._over:
            return
        self._over = True
        # Every write is behind: let the sink go. Its ``on_cut`` holds this stream's ``end``, so the pair held both
        # ways made every stream a reference cycle (with its reservation, exchange and the connection's cycle) that
        # only the cyclic collector freed: ~35 objects a stream, a young collection of ~10 ms under 256 streams.
        self._out = None
        self.engine.progress.unwatch(self._watch)
        close(self.parts, self.engine, self.stream)
        self.reservation.release(completed=self.outcome == "ok")
        if self.outcome == "ok" and self.usage.reported:
            self.parts.metrics.record_output_tokens(self.usage.generated)
        self.parts.metrics.record_upstream_latency(self.route, time.perf_counter() - self.t0)
        self.parts.metrics.record_request(self.route, self.outcome)
        self._trace.stream_end(self.reservation, self.outcome, self._error)
